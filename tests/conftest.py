"""Shared pytest fixtures (pytest loads this file itself; run the suite with `python -m pytest -q`).

`bandit_tiny`: a small tiny-policy build (2 layers, hidden 64, bandit only, warmed up for 60 steps; seconds to
build) saved as a folder, for the subprocess runs of train.py (tests/test_train.py, tests/test_distributed.py).
Built once per test session.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def bandit_tiny(tmp_path_factory) -> str:
    import torch
    torch.set_num_threads(1)
    from policy import ensure_tiny
    return ensure_tiny(str(tmp_path_factory.mktemp("tiny")), progress=False,
                       warmup=dict(steps=60, episodes_per_env=64),
                       model_cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
                       envs=["bandit"])
