"""Progress of the long passes (ntkgp.progress): silent, a bar, or — off a terminal — one line with the estimated
time of the whole pass, formed after the first batches."""

import logging

import pytest
import torch

import ntkgp.progress as progress_module
from ntkgp.laplace import compute_curvature
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.progress import check_progress, format_seconds, progress_bar


class Clock:
    """A fake ``time.monotonic``: each batch takes ``step`` seconds (advanced by the consumer)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def consume(items, clock, step):
    seen = []
    for item in items:
        clock.now += step
        seen.append(item)
    return seen


def test_off_a_terminal_one_line_gives_the_estimated_time_of_the_whole_pass(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    seen = consume(progress_bar(range(100), None, "KFAC", None), clock, step=2.0)
    assert seen == list(range(100))  # every item, in order
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    # after 3 batches of 2 s: 6 s elapsed, 97 more at 2 s each: 200 s in all
    assert "KFAC: 3 of 100 batches in 6 s" in lines[0] and "about 3.3 min in all" in lines[0]


def test_a_short_pass_says_nothing_and_false_is_silent(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    consume(progress_bar(range(10), None, "KFAC", None), clock, step=0.1)  # 1 s in all: below the threshold
    consume(progress_bar(range(100), None, "KFAC", False), clock, step=10.0)
    assert capsys.readouterr().err == ""


def test_true_shows_a_bar(capsys):
    assert list(progress_bar(iter(range(5)), 5, "diagonal GGN", True)) == list(range(5))
    assert "diagonal GGN" in capsys.readouterr().err


def test_the_line_goes_to_the_ntkgp_logger_when_it_is_configured(monkeypatch, caplog):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    with caplog.at_level(logging.INFO, logger="ntkgp"):
        consume(progress_bar(range(50), 50, "full GGN", None), clock, step=1.0)
    assert any("full GGN: 3 of 50 batches" in r.getMessage() for r in caplog.records)


def test_a_curvature_pass_announces_itself_off_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "LOG_AFTER_SECONDS", 0.0)  # announce every pass, however short
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    x, y = torch.randn(40, 2), torch.randint(0, 3, (40,))
    compute_curvature(net, x, y, SoftmaxLikelihood(num_classes=3), structure="kfac", batch_size=10)
    err = capsys.readouterr().err
    assert "KFAC: 3 of 4 batches" in err
    compute_curvature(net, x, y, SoftmaxLikelihood(num_classes=3), structure="kfac", batch_size=10, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("bad", [1, "yes", 0.5])
def test_progress_is_checked(bad):
    with pytest.raises(TypeError, match="progress"):
        check_progress(bad)
    with pytest.raises(TypeError, match="progress"):
        list(progress_bar(range(3), 3, "x", bad))


def test_durations_read_naturally():
    assert format_seconds(42) == "42 s"
    assert format_seconds(600) == "10.0 min"
    assert format_seconds(7200) == "2.0 h"
