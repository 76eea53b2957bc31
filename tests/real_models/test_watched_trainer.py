"""``ddparity watch`` on a transformers ``Trainer`` run (GPT-2 tiny from a config, gradient
accumulation, accelerate's DDP): a loop nobody wrote for ddparity, watched clean and with
a fault planted from a ``TrainerCallback`` (the real-models sweep: .ci/run runs it)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.e2e.test_watch import only_run, watch

pytestmark = [pytest.mark.real_models, pytest.mark.usefixtures("no_leftover_processes"),
              pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("transformers", "accelerate")),
                                 reason="needs transformers and accelerate (pip install -e '.[real]')")]

TRAINER = "ddparity.fixtures.scripts.hf_trainer"


def test_a_clean_trainer_run_passes_with_its_replicas_compared_every_optimizer_step(tmp_path):
    result, data = watch(tmp_path, 2, TRAINER, "--steps", "4", "--output-dir", str(tmp_path), timeout=60)
    assert result.returncode == 0, result.stderr
    run = only_run(data)
    assert (run["mode"], run["status"]) == ("ddp", "pass")
    assert any("4 optimizer step(s) fingerprinted and compared across ddp replicas" in n for n in run["notes"])


def test_a_rank_local_learning_rate_in_a_trainer_callback_is_drift_naming_the_last_rank(tmp_path):
    result, data = watch(tmp_path, 3, TRAINER, "--steps", "5", "--fault", "drift", "--on", "-1", "--at", "1",
                         "--output-dir", str(tmp_path), timeout=60)
    assert result.returncode == 1, result.stderr
    desync = only_run(data)["desync"]
    assert desync["ranks"] == [2] and desync["step"] == 2
    assert "transformer.h.0" in desync["what"] or "transformer.wte.weight" in desync["what"]


def test_a_trainer_rank_0_that_raises_is_a_crash_with_its_traceback(tmp_path):
    result, data = watch(tmp_path, 2, TRAINER, "--fault", "raise", "--on", "0", "--output-dir", str(tmp_path),
                         timeout=60)
    assert result.returncode == 3, result.stderr
    crash = only_run(data)["crash"]
    assert crash["rank"] == 0 and "labels out of range" in crash["error"]
