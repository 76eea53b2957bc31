"""``ddparity profile`` as a user runs it: figures, JSON, plot, failures, bad input."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from ddparity.case import takes_bucket_lists
from ddparity.settings import REAL_RANKS_LIMIT
from tests.e2e.test_cli import ddparity

WIDE_MLP_PARAMS = 2_107_658  # ddparity.fixtures.models.WideMLP

USER_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from ddparity import Case
    from ddparity.fixtures.models import WideMLP, wide_vectors

    def fp16():
        return Case(model=WideMLP, data=wide_vectors, optimizer="adam", lr=1e-3, steps=2,
                    ddp_options={"bucket_cap_mb": 1}, comm_hook=default_hooks.fp16_compress_hook)

    SLEEP_S = 0.05

    def _late_allreduce(state, bucket):
        import time

        def late(fut):
            time.sleep(SLEEP_S)  # the bucket's all-reduce completes 50 ms later than it would
            return fut.value()

        return default_hooks.allreduce_hook(None, bucket).then(late)

    def one_bucket():
        return Case(model=lambda: nn.Linear(64, 8), data=_batch, optimizer="sgd", steps=2)

    def one_late_bucket():
        case = one_bucket()
        case.comm_hook = _late_allreduce
        return case

    def _batch(step, generator):
        return torch.randn(16, 64, generator=generator), torch.randint(0, 8, (16,), generator=generator)

    def odd_batch():
        return Case(model=lambda: nn.Linear(6, 3),
                    data=lambda s, g: (torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)))
    """
)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "comm_cases.py"
    path.write_text(USER_FILE)
    return path


def test_demo_profile_measures_the_buckets_and_writes_json_and_a_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "profile.json", tmp_path / "profile.png"
    result = ddparity("profile", "--demo", "--world-sizes", "1,2", "--steps", "3", "--warmup", "1",
                      "--json", str(out), "--plot", str(png))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ddparity profile: demo: wide MLP" in result.stdout and "busbw GB/s" in result.stdout
    data = json.loads(out.read_text())
    assert data["version"] == 1 and data["cpus"] >= 1
    one, two = data["runs"]
    assert (one["world_size"], one["status"], two["world_size"], two["status"]) == (1, "ok", 2, "ok")
    for run in (one, two):
        assert run["steps"] == 3 and run["backend"] == "gloo" and run["device"] == "cpu"
        assert run["bytes_per_step"] == 4 * WIDE_MLP_PARAMS  # every float32 gradient, once a step
        assert run["buckets"] >= 2  # 8.4 MB of gradients, 1 MB bucket cap (a big tensor fills one alone)
        assert run["step_s"] > 0 and run["compute_s"] > 0 and run["comm_s"] > 0
        assert run["step_p95_s"] >= run["step_s"]
        assert run["exposed_comm_s"] >= 0 and 0.0 <= run["overlap"] <= 1.0
    assert one["busbw_gbps"] is None and one["scaling_efficiency"] == 1.0
    assert two["busbw_gbps"] == pytest.approx(two["algbw_gbps"])  # 2(n-1)/n = 1 at n = 2
    assert two["samples_per_step"] == 48 and two["scaling_efficiency"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["recommendation"].startswith("only ddp ran at 2 rank(s): ")  # one arm: no ranking
    assert f"recommendation: {data['recommendation']}" in result.stdout


def test_ddps_settings_swept_are_arms_of_one_table_each_with_its_known_answer(tmp_path):
    """--bucket-cap-mb and --comm-hook: one row an arm at each world size, timed in the same
    warm worlds. Known answers: every bucket arm all-reduces the model's gradient bytes once a
    step, in fewer buckets as the cap grows (8.4 MB of gradients: one bucket at 100 MB; DDP's
    own first bucket is 1 MB until it rebuilds); fp16 sends half; PowerSGD over gloo is a
    skipped row saying why (a plain DDP script hangs the same way). The last line ranks them."""
    out = tmp_path / "sweep.json"
    lists = ("--bucket-cap-mb-list", "1:100") if takes_bucket_lists() else ()  # caps bucket by bucket: newer torch
    result = ddparity("profile", "--demo", "--world-sizes", "1,2", "--bucket-cap-mb", "1,100", *lists, "--ddp",
                      "gradient_as_bucket_view", "--comm-hook", "fp16,powersgd", "--steps", "3", "--warmup", "2",
                      "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    runs = {(r["arm"], r["world_size"]): r for r in json.loads(out.read_text())["runs"]}
    assert list(dict.fromkeys(a for a, _ in runs)) == ["ddp bucket 1 MB", "ddp bucket 100 MB",
                                                       *(["ddp buckets 1:100 MB"] if lists else []),
                                                       "ddp gradient_as_bucket_view", "ddp fp16 hook",
                                                       "ddp powersgd hook"]
    assert runs["ddp bucket 100 MB", 2]["bucket_cap_mb"] == 100 and runs["ddp fp16 hook", 2]["bucket_cap_mb"] is None
    if lists:  # the first bucket 1 MB (the last layer, whose gradients come first), the rest in one of 100 MB
        listed = runs["ddp buckets 1:100 MB", 2]
        assert listed["buckets"] == 2 == listed["ddp_logging"]["buckets"], listed
        assert listed["bytes_per_step"] == 4 * WIDE_MLP_PARAMS and "--bucket-cap-mb-list 1:100" in listed["repro"]
    # memory a rank: DDP's flat buckets copy the gradients, unless they are views of them; a step's activations
    copies, views = runs["ddp bucket 1 MB", 2]["memory_per_rank"], runs["ddp gradient_as_bucket_view", 2]["memory_per_rank"]
    assert copies["ddp_buckets"] == copies["grads"] == 4 * WIDE_MLP_PARAMS and views["ddp_buckets"] == 0
    assert copies["activations"] > 0 and runs["ddp bucket 1 MB", 2]["step_memory"] == sum(copies.values())
    small, large, half = runs["ddp bucket 1 MB", 2], runs["ddp bucket 100 MB", 2], runs["ddp fp16 hook", 2]
    assert small["bytes_per_step"] == large["bytes_per_step"] == 4 * WIDE_MLP_PARAMS == 2 * half["bytes_per_step"]
    assert small["buckets"] >= 3 and large["buckets"] == 1, (small["buckets"], large["buckets"])  # 3 tensors > 1 MB
    assert small["scaling_efficiency"] > 0 and runs["ddp bucket 1 MB", 1]["scaling_efficiency"] == 1.0  # per arm
    for arm in (small, large, half):  # DDP's own logger counts the same buckets (rebuilt after the first step)
        assert arm["ddp_logging"]["buckets"] == arm["buckets"] and arm["ddp_logging"]["rebuilt"], arm["ddp_logging"]
        assert not any(n.startswith("DDP's own logging reports") for n in arm["notes"]), arm["notes"]
    assert "ddp bucket 100 MB world size 2: DDP's own logging: forward " in result.stdout
    powersgd = runs["ddp powersgd hook", 2]
    assert powersgd["status"] == "skipped" and "not timed over gloo" in powersgd["reason"]
    assert runs["ddp powersgd hook", 1]["status"] == "skipped"  # at every size: one rank is no baseline of nothing
    assert "--bucket-cap-mb 100 --world-sizes 2" in large["repro"] and "--comm-hook fp16" in half["repro"]
    assert re.search(r"^  ddp bucket 100 MB +2 +gloo +ok ", result.stdout, re.M)  # the table names the arm
    last = result.stdout.rstrip().splitlines()[-1]
    assert last.startswith(("recommendation: fastest at 2 rank(s): ddp ", "recommendation: too close to rank at 2")), last


def test_dataparallel_is_timed_on_gpus_and_elsewhere_its_row_says_why_not(tmp_path):
    """No figure from emulation: without two CUDA devices each dp row is skipped with the reason
    (the ddp rows beside it timed as ever); with them, DataParallel's whole step and each
    device's peak memory (device 0's against the others')."""
    from ddparity.harness.world.rendezvous import cuda_device_count

    out = tmp_path / "dp.json"
    result = ddparity("profile", "--demo", "--modes", "dp,ddp", "--world-sizes", "1,2", "--steps", "2", "--warmup", "1",
                      "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    runs = {(r["mode"], r["world_size"]): r for r in json.loads(out.read_text())["runs"]}
    assert runs["dp", 1]["status"] == "skipped" and "over one device is the model alone" in runs["dp", 1]["reason"]
    assert runs["ddp", 2]["status"] == "ok"
    if cuda_device_count() >= 2:
        dp = runs["dp", 2]
        assert dp["status"] == "ok" and dp["step_s"] > 0 and dp["step_p95_s"] >= dp["step_s"], dp
        assert any(n.startswith("peak allocated per device: cuda:0 ") for n in dp["notes"]), dp["notes"]
    else:
        assert runs["dp", 2]["status"] == "skipped" and "emulation of it on one device gives no figure" in \
            runs["dp", 2]["reason"]
        assert "dp    2      gloo     SKIPPED" in result.stdout


def test_a_compression_hook_sends_half_the_bytes(user_file):
    result = ddparity("profile", f"{user_file}:fp16", "--world-sizes", "2", "--steps", "2", "--warmup", "1",
                      "--json", str(user_file.parent / "fp16.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    [run] = json.loads((user_file.parent / "fp16.json").read_text())["runs"]
    assert run["bytes_per_step"] == 2 * WIDE_MLP_PARAMS  # float16 on the wire


def test_a_comm_hook_that_completes_50_ms_late_adds_them_to_comm_and_exposed_time(user_file, tmp_path):
    """A known answer: one bucket whose all-reduce completes 50 ms late adds at least 50 ms
    to the time it is in flight, and (the last bucket: nothing left to hide it behind) to
    the exposed communication; the compute (no_sync) is left as it is."""
    figures = {}
    for name in ("one_bucket", "one_late_bucket"):
        out = tmp_path / f"{name}.json"
        result = ddparity("profile", f"{user_file}:{name}", "--world-sizes", "2", "--steps", "3", "--warmup", "1",
                          "--json", str(out))
        assert result.returncode == 0, result.stdout + result.stderr
        [run] = json.loads(out.read_text())["runs"]
        assert run["status"] == "ok" and run["buckets"] == 1, run
        figures[name] = run
    plain, late = figures["one_bucket"], figures["one_late_bucket"]
    # lower bounds only (a sleep never takes less; a loaded machine may add): 45 ms leaves
    # room for one iteration's compute measured slower than the step's
    assert late["comm_s"] >= 0.05 and plain["comm_s"] < late["comm_s"], (plain, late)
    assert late["exposed_comm_s"] >= 0.045 and plain["exposed_comm_s"] < late["exposed_comm_s"], (plain, late)
    assert late["step_s"] - late["compute_s"] >= 0.045, late  # the sleep is not counted as compute


def test_a_hanging_rank_exits_3_with_its_position_and_stack():
    result = ddparity("profile", "ddparity.fixtures.faults:stuck_rank", "--world-sizes", "2", "--timeout", "2",
                      "--steps", "3")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "world size 2 HANG" in result.stdout and "suspect ranks: [1]" in result.stdout
    assert "rank 1: step 0, profile forward" in result.stdout and "_inject" in result.stdout


def test_a_crashing_rank_exits_3_naming_it():
    result = ddparity("profile", "ddparity.fixtures.faults:raising_rank", "--world-sizes", "2", "--steps", "3")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "world size 2 CRASH" in result.stdout and "rank 1" in result.stdout
    assert "reproduce: ddparity profile ddparity.fixtures.faults:raising_rank --world-sizes 2 --backend gloo" \
        in result.stdout


def test_unrunnable_sizes_are_explained(user_file):
    too_many = REAL_RANKS_LIMIT + 1
    result = ddparity("profile", f"{user_file}:odd_batch", "--world-sizes", f"2,4,{too_many}", "--steps", "2")
    assert result.returncode == 2, result.stdout + result.stderr  # a batch of 6 cannot be split in 4
    assert "world size 4 ERROR: the global batch of step 0 has 6 samples" in result.stdout
    assert f"world size {too_many} SKIPPED: {too_many} ranks exceed this machine's limit" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_plot_without_matplotlib_names_the_install(monkeypatch):
    import sys

    from ddparity.errors import UsageError
    from ddparity.plot import check_plot_path

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(UsageError, match=r"--plot needs matplotlib: pip install matplotlib \(or, in a clone of ddparity"):
        check_plot_path("profile.png")


@pytest.mark.parametrize(("args", "message"), [
    ((), "missing TARGET"),
    (("--demo", "--backend", "threaded"), "profiling needs real rank processes"),
    (("--demo", "--plot", "out.jpg"), "use a file name ending in .png, .svg, .pdf"),
    (("--demo", "--plot", "/no/such/folder/p.png"), "does not exist"),
    (("--demo", "--warmup", "-1"), "expected an integer >= 0"),
    (("no_such_module:case",), "no_such_module"),
    (("--demo", "--bucket-cap-mb", "0,25"), "bucket caps must be positive sizes in MB"),
    (("--demo", "--bucket-cap-mb-list", "1:0"), "bucket caps must be positive sizes in MB"),
    (("--demo", "--ddp", "fast"), "--ddp 'fast' is not one of DDP's options swept here: gradient_as_bucket_view"),
    (("--demo", "--comm-hook", "int8"), "--comm-hook 'int8' is not one of allreduce, fp16, bf16, powersgd"),
    (("--demo", "--modes", "fsdp", "--bucket-cap-mb", "1"), "--bucket-cap-mb sweep DDP's settings: add ddp to --modes"),
])
def test_bad_input_exits_2_with_a_message(args, message):
    result = ddparity("profile", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_the_plot_keeps_every_world_size_in_place_and_no_legend_over_the_data():
    """A skipped world size silently disappeared; the panels spaced their x axes differently
    (categories left, numbers right); the legend sat on the world-size-2 bandwidth point."""
    pytest.importorskip("matplotlib")
    from ddparity.checks.comm import WorldProfile
    from ddparity.plot import figure
    from ddparity.report import ProfileReport

    def ok(ws, step, busbw):
        return WorldProfile(ws, "gloo", step_s=step, compute_s=step / 2, exposed_comm_s=step / 2, busbw_gbps=busbw,
                            scaling_efficiency=1.0 / ws)

    fig = figure(ProfileReport("c", [ok(1, 0.02, None), ok(2, 0.05, 0.33), ok(4, 0.08, 0.24),
                                     WorldProfile(8, "gloo", status="skipped", reason="too many")]))
    left, right = fig.axes[0], fig.axes[1]
    for ax in (left, right):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8\n(skipped)"]
        assert list(ax.get_xticks()) == [0, 1, 2, 3]
    fig.canvas.draw()
    for ax in (left, right):  # outside the axes (over them), not on the data
        assert ax.get_legend().get_window_extent().y0 > ax.get_window_extent().y1
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_plot_draws_memory_a_rank_and_the_bucket_size_curve():
    """Bottom left: what a rank holds in a step, stacked by kind (the row's figures, in MB).
    Bottom right: a bucket sweep's step time against the cap, a line a world size with bars
    to p95, exposed communication dashed; without a sweep of two caps it says how to draw it."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from ddparity.checks.comm import WorldProfile
    from ddparity.plot import figure
    from ddparity.report import ProfileReport

    held = {"params": 4_000_000, "grads": 4_000_000, "optimizer": 8_000_000, "ddp_buckets": 4_000_000,
            "activations": 500_000}

    def row(ws, cap, step):
        return WorldProfile(ws, "gloo", arm=f"ddp bucket {cap:g} MB", bucket_cap_mb=cap, step_s=step,
                            step_p95_s=step * 1.5, compute_s=step / 2, exposed_comm_s=step / 4,
                            scaling_efficiency=1.0, memory_per_rank=dict(held))

    fig = figure(ProfileReport("c", [row(1, 1, 0.02), row(2, 1, 0.04), row(1, 25, 0.02), row(2, 25, 0.03)]))
    memory, curve = fig.axes[2], fig.axes[3]
    tops = {round(p.get_y() + p.get_height(), 3) for p in memory.patches}
    assert max(tops) == pytest.approx(sum(held.values()) / 1e6, rel=1e-3)  # every kind stacked, in MB
    assert [t.get_text() for t in memory.get_legend().get_texts()][:2] == ["parameters", "gradients"]
    assert curve.get_xscale() == "log" and curve.get_xlabel() == "DDP bucket cap, MB"
    lines = {line.get_label(): list(line.get_ydata()) for line in curve.get_lines() if not line.get_label().startswith("_")}
    bars = {c.get_label(): list(c.lines[0].get_ydata()) for c in curve.containers}
    assert bars["2 rank(s): step p50 (bar to p95)"] == pytest.approx([40.0, 30.0])
    assert lines["2 rank(s): exposed communication"] == pytest.approx([10.0, 7.5])
    plt.close(fig)
    fig = figure(ProfileReport("c", [WorldProfile(2, "gloo", step_s=0.02, compute_s=0.01, exposed_comm_s=0.01)]))
    assert not fig.axes[3].axison and "--bucket-cap-mb" in fig.axes[3].texts[0].get_text()
    plt.close(fig)


def test_a_bucket_list_sweep_on_a_torch_without_it_names_the_fix(monkeypatch):
    from ddparity.errors import UsageError
    from ddparity.fixtures.models import profile_demo
    from ddparity.verbs import profile_arms

    monkeypatch.setattr(profile_arms, "takes_bucket_lists", lambda: False)
    with pytest.raises(UsageError, match=r"--bucket-cap-mb-list: DistributedDataParallel in torch .* takes no "
                                         r"bucket_cap_mb_list \(newer torch releases do\): upgrade torch"):
        profile_arms.arms(profile_demo(), ("ddp",), profile_arms.Sweep.of(bucket_cap_mb_list=[(1, 25)]))
    with pytest.raises(UsageError, match=r"lists of positive sizes in MB, bucket by bucket"):
        profile_arms.arms(profile_demo(), ("ddp",), profile_arms.Sweep.of(bucket_cap_mb_list=["1:25"]))

