"""Hand in: grade this copy, then pack what a student hands in into one archive (as CS336's
make_submission.sh does).

    python course/submit.py                   # -> submission.zip in this folder
    python course/submit.py --out me.zip

The archive holds `grade.json` (what `python course/grade.py --json` says of units 1-6 here), the unit files
(envs.py rollout.py advantages.py starpo.py filter.py monitor.py), `course/lab-answers.md`, the plots (*.png
in this folder and under plots/) and `MANIFEST.txt` (each file's size and sha256). Never runs/, models/,
checkpoints or weights: the instructor grades the unit files in a fresh copy of their own and reads the
answers, whose numbers the student quotes. Failing units do not stop the archive; the summary says so.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from engine.cli import Parser, fail  # noqa: E402
from units import UNITS  # noqa: E402

ANSWERS = "course/lab-answers.md"
PLOT_MAX = 10 * 2 ** 20  # a plot is a few hundred KiB; anything larger is not one
UNANSWERED = "Answer: ..."  # the template's placeholder


def handed_in(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(the files to pack, relative to root; what was left out and why)."""
    files = [u["file"] for u in UNITS if not u.get("lab")]
    notes = []
    if (root / ANSWERS).is_file():
        files.append(ANSWERS)
    plots = sorted(root.glob("*.png")) + sorted((root / "plots").rglob("*.png"))
    for p in plots:
        rel = p.relative_to(root).as_posix()
        if p.stat().st_size > PLOT_MAX:
            notes.append(f"{rel} left out: over {PLOT_MAX // 2 ** 20} MiB, not a plot")
        else:
            files.append(rel)
    return files, notes


def grade(root: Path = ROOT) -> dict:
    """course/grade.py --json of units 1-6, run as the student runs it; its lines are printed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "grade.json"
        p = subprocess.run([sys.executable, str(root / "course" / "grade.py"), "--json", str(out)], cwd=root,
                           capture_output=True, text=True)
        print(p.stdout, end="")
        if p.returncode not in (0, 1) or not out.is_file():
            last = (p.stderr.strip().splitlines() or [""])[-1]
            fail(f"course/grade.py stopped (exit {p.returncode}): {last}; nothing packed", "submit.py")
        return json.loads(out.read_text())


def pack(out: Path, files: list[str], graded: dict, root: Path = ROOT) -> None:
    manifest = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        text = json.dumps(graded, indent=1) + "\n"
        z.writestr("grade.json", text)
        manifest.append(f"grade.json {len(text.encode())} {hashlib.sha256(text.encode()).hexdigest()}")
        for rel in files:
            data = (root / rel).read_bytes()
            z.writestr(rel, data)
            manifest.append(f"{rel} {len(data)} {hashlib.sha256(data).hexdigest()}")
        z.writestr("MANIFEST.txt", "file bytes sha256\n" + "\n".join(manifest) + "\n")


def main(argv=None) -> int:
    parser = Parser(prog="submit.py", description=__doc__.split("\n")[0])  # errors: one line, exit 2
    parser.add_argument("--out", default="submission.zip", help="the archive to write (a new file; default: "
                                                                "submission.zip)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        parser.error(f"--out {args.out}: exists; nothing is replaced: choose another name or remove it")
    if out.suffix != ".zip":
        parser.error(f"--out {args.out}: the archive is a .zip")
    files, notes = handed_in()
    graded = grade()
    pack(out, files, graded)
    for note in notes:
        print(f"note: {note}")
    answers = (ROOT / ANSWERS).read_text() if (ROOT / ANSWERS).is_file() else ""
    open_ = answers.count(UNANSWERED)
    if open_:
        print(f"note: {ANSWERS} still has {open_} unanswered question{'s' * (open_ > 1)} ('{UNANSWERED}')")
    print(f"wrote {out}: {len(files) + 2} files ({out.stat().st_size // 1024} KiB): grade.json, "
          f"MANIFEST.txt, {', '.join(files)}; units: {graded['passed']}/{graded['graded']} pass, "
          f"{graded['points']:g}/{graded['max_points']} points (the labs' points come from the answers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
