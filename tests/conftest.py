"""Shared pytest fixtures (pytest loads this file itself; run the suite with `python -m pytest -q`).

Tests never train the shipped prior's ~1M parameters: they use small builds of the same recipe (prior.py), each
built once per test session into pytest's temporary folder (seconds):
- `small_path` / `small`: SMALL, bandit and sokoban, 2 layers of hidden 64, 80 warm-up steps; its replies are a mix
  of well-formed and broken ones, which is what the rollout tests need. `small` is (model, tokenizer).
- `bandit_tiny`: bandit only, 60 warm-up steps, a folder for the subprocess runs of train.py.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMALL = dict(envs=["bandit", "sokoban"],
             warmup=dict(episodes_per_env=32, steps=80, batch_tokens=2048, lr=2e-2),
             model_cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1))
# A build that only has to exist (cache-key and offline tests): ~1 s.
MICRO = dict(envs=["bandit"], warmup=dict(episodes_per_env=8, steps=2, batch_tokens=512),
             model_cfg=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1))


# The tests of the paper's files (README's reading path): marked `paper`, the tier a student runs while
# reading (python -m pytest -m paper), but for the tests marked `end_to_end`.
PAPER_TESTS = {"test_envs.py", "test_rollout.py", "test_filter.py", "test_advantages.py", "test_starpo.py",
               "test_train.py", "test_monitor.py", "test_eval.py", "test_sft.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in PAPER_TESTS and not item.get_closest_marker("end_to_end"):
            item.add_marker(pytest.mark.paper)


@pytest.fixture(scope="session")
def small_path(tmp_path_factory) -> str:
    import torch
    torch.set_num_threads(1)
    from tools.prior import ensure_tiny
    return ensure_tiny(str(tmp_path_factory.getbasetemp() / "tiny-cache"), progress=False, **SMALL)


@pytest.fixture(scope="session")
def small(small_path):
    from engine.models import load_policy
    model, tok, _ = load_policy(small_path)
    return model, tok


@pytest.fixture(scope="session")
def bandit_tiny(tmp_path_factory) -> str:
    import torch
    torch.set_num_threads(1)
    from tools.prior import ensure_tiny
    return ensure_tiny(str(tmp_path_factory.mktemp("tiny")), progress=False,
                       warmup=dict(steps=60, episodes_per_env=64),
                       model_cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
                       envs=["bandit"])


@pytest.fixture(scope="session")
def random_llama(tmp_path_factory) -> str:
    """A random LlamaForCausalLM (SmolLM2's architecture) of small widths with the shipped prior's tokenizer,
    saved as a model folder: a real Llama path through loading, the engine, LoRA and the update."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models import load_policy
    _, tok, _ = load_policy("tiny")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def _fp32_after_each_test():
    """An in-process run with --dtype bf16 sets the process's autocast dtype (engine/models.setup_device): the
    next test starts from the default again."""
    yield
    from engine import models
    models._AMP.clear()
