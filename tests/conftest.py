import logging

import pytest
import torch

import ntkgp.progress as progress_module


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow to run")
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)


# ---------------------------------------------------------------- progress tests
@pytest.fixture
def announce_every_pass(monkeypatch):
    """An auto pass prints its estimate however short it is (the threshold is for real, long passes)."""
    monkeypatch.setattr(progress_module, "LOG_AFTER_SECONDS", -1.0)


@pytest.fixture
def said(capsys, caplog):
    """What the passes said since the last call: standard error and the ``"ntkgp"`` logger's records."""
    caplog.set_level(logging.DEBUG, logger="ntkgp")

    def read():
        text = capsys.readouterr().err + "".join(r.getMessage() + "\n" for r in caplog.records)
        caplog.clear()
        return text

    return read
