"""`mptrain bench e2e --quick`: the harness end to end on the CPU with tiny models (no speed claims)."""
from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from mptrain.bench import e2e

CASES = ["mptrain:bf16-master", "lightning:bf16-mixed", "lightning+compile:bf16-mixed", "mptrain+compile:best",
         "mptrain+cuda_graphs:bf16-master"]


@pytest.mark.slow
def test_quick_run_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    rc = e2e.main(["--quick", "--models", "resnet50,bert", "--cases", ",".join(CASES), "--warmup", "1",
                   "--steps", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    results = {(r["model"], r["case"]): r for r in data["results"]}
    assert set(results) == {(m, c) for m in ("resnet50", "bert") for c in CASES}
    errors = {k: r["message"] for k, r in results.items() if r["status"] == "error"}
    assert rc == (1 if errors else 0)
    for key, r in results.items():
        if r["status"] == "ok":
            assert r["samples_per_s"] > 0 and r["step_ms"] > 0, key
            assert r["syncs_per_step"] is None and r["peak_mem_gb"] is None  # CUDA-only measurements
        else:  # a refused feature is reported with the trainer's reason, never timed as something else
            assert r["message"] and r["samples_per_s"] is None, key
    assert results[("resnet50", "mptrain+compile:best")]["precision"] == "bf16-master"  # the only eager mode run
    for model in ("resnet50", "bert"):
        ratio = data["summary"][model]["ratios"]["mptrain_best / lightning_best"]
        assert ratio is None or ratio > 0
    assert "vs L best" in printed and "img/s" in printed and "seq/s" in printed
    assert data["meta"]["fused_kernels"].startswith("not used")
    assert not errors, errors


@pytest.mark.slow
def test_each_case_starts_from_a_fresh_dynamo_state(monkeypatch):
    """A compiled case does not inherit dynamo's cache entries from the cases before it: in one process
    they pile up across precisions until a shared frame reaches the recompile limit and runs eagerly.
    (Counted when each case's fit ends: the case resets dynamo again once it is over.)"""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    code = L.LightningModule.log.__code__  # compiled by every Lightning + compile case
    counts = []
    record = e2e._record
    monkeypatch.setattr(e2e, "_record", lambda *a: (counts.append(len(_debug_get_cache_entry_list(code))),
                                                    record(*a)))
    for precision in ("bf16-true", "bf16-mixed"):
        assert e2e.run_case("bert", f"lightning+compile:{precision}", precision, 1, 1, True).status == "ok"
    assert len(_debug_get_cache_entry_list(code)) == 0  # nothing left once the case is over
    assert e2e.run_case("bert", "lightning+compile:bf16-mixed", "bf16-mixed", 1, 1, True).status == "ok"
    first, after_one, alone = counts
    assert alone > 0, "the case compiled nothing: the check would prove nothing"
    assert after_one == alone == first


def test_bad_arguments_name_the_valid_values(capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--models", "gpt2"])
    assert "resnet50, bert" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.main(["--cases", "lightning:fp8"])
    assert "mptrain:bf16-master" in capsys.readouterr().err


def test_needs_a_gpu_without_quick(monkeypatch, capsys):
    monkeypatch.setattr(e2e.torch.cuda, "is_available", lambda: False)
    assert e2e.main([]) == 2
    assert "--quick" in capsys.readouterr().err


def test_sync_counter_counts_synchronizing_calls_in_the_window(monkeypatch):
    """The window logic on a fake CUDA: syncs are counted in the steps after the timed ones, which run
    without the debug mode and the warning capture."""
    import warnings

    calls = []
    monkeypatch.setattr(e2e.torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(e2e.torch.cuda, "set_sync_debug_mode", lambda mode: calls.append(mode))

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return 6.0

    monkeypatch.setattr(e2e.torch.cuda, "Event", Event)
    timer = e2e.StepTimer(warmup=1, steps=2, sync_steps=2)
    timer.cuda = True
    assert timer.total == 5
    for step in range(timer.total):
        if step > 0:  # the timed steps sync too: only the sync window's count
            warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("unrelated")
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations")  # what torch says when the mode is set: not a sync
        timer.on_train_batch_end(None, None, None, None, step)
        if step == 2:  # the timed window is closed before the debug mode goes on
            assert timer.gpu_ms == 3.0 and timer.syncs is None and calls == ["sync", "sync", "warn"]
    assert timer.syncs == 2 and timer.gpu_ms == 3.0
    assert list(timer.sync_sites.values()) == [2] and __file__ in next(iter(timer.sync_sites))
    assert calls == ["sync", "sync", "warn", "default"]


def test_timed_window_opens_after_a_collection_and_reports_those_inside_it():
    """Garbage left by the compile and the warm-up is collected before the window's clock starts;
    a collection inside the window is counted (time and full ones), none after it."""
    import gc
    import weakref

    class Node:
        pass

    timer = e2e.StepTimer(warmup=1, steps=2, sync_steps=0)
    timer.cuda = False
    cycle = Node()
    cycle.me = cycle  # only the collector frees a reference cycle
    ref = weakref.ref(cycle)
    del cycle
    gc.disable()  # no automatic collection in between
    try:
        timer.on_train_batch_end(None, None, None, None, 0)  # warm-up over: the window opens
        assert ref() is None and timer.gc_full == 0
        gc.collect()  # a full collection inside the window
        timer.on_train_batch_end(None, None, None, None, 1)
        timer.on_train_batch_end(None, None, None, None, 2)  # the window closes
        assert timer.t1 is not None
        gc.collect()  # after the window: not counted
    finally:
        gc.enable()
    assert timer.gc_full == 1 and timer.gc_ms > 0
    assert timer._gc_pause not in gc.callbacks
    paused = e2e.Result("bert", "mptrain:bf16-master", "bf16-master", 8, samples_per_s=1.0, step_ms=8.0,
                        gc_ms_per_step=0.5, gc_full=1)
    assert "1 full garbage collection(s) in the timed window, 0.50 ms/step" in e2e.format_table([paused])


def test_repeats_alternate_the_order_and_report_the_median_run():
    orders = e2e.case_orders(["mptrain:bf16-master", "lightning:bf16-true", "mptrain+compile:best"], 3)
    assert orders == [["mptrain:bf16-master", "lightning:bf16-true", "mptrain+compile:best"],
                      ["lightning:bf16-true", "mptrain:bf16-master", "mptrain+compile:best"],
                      ["mptrain:bf16-master", "lightning:bf16-true", "mptrain+compile:best"]]
    runs = [e2e.Result("bert", "a", "bf16-master", 2, samples_per_s=v) for v in (30.0, 10.0, 20.0)]
    runs += [e2e.Result("bert", "b", "bf16-true", 2, status="error", message="x"),
             e2e.Result("bert", "b", "bf16-true", 2, samples_per_s=5.0)]
    med = e2e.median_runs(runs)
    assert [(r.case, r.samples_per_s) for r in med] == [("a", 20.0), ("b", 5.0)]


def test_paired_ratios_compare_the_cases_of_each_pass():
    def res(case, rate, status="ok", model="bert"):
        return e2e.Result(model, case, "x", 2, status=status, samples_per_s=rate)

    runs = [res("mptrain:16-mixed", 90.0), res("lightning:16-mixed", 100.0), res("mptrain:bf16-mixed", 10.0),
            res("lightning:bf16-mixed", None, status="error"), res("lightning:16-mixed", 50.0),
            res("mptrain:16-mixed", 60.0), res("mptrain:16-mixed", 1.0, model="resnet50")]
    # pass by pass: each ratio from two cases run seconds apart (the medians may mix passes)
    assert e2e.paired_ratios(runs, "bert", "mptrain:16-mixed", "lightning:16-mixed") == [0.9, 1.2]
    assert e2e.paired_ratios(runs, "bert", "mptrain:bf16-mixed", "lightning:bf16-mixed") == []
    summary = e2e.summarize(e2e.median_runs(runs), "bert", runs)
    assert summary["ratios"]["mptrain:16-mixed / lightning:16-mixed"] == pytest.approx(1.05)  # median of 0.9, 1.2
    assert summary["each_pass"]["mptrain:16-mixed / lightning:16-mixed"] == [0.9, 1.2]


USER_QUICK_CASES = ["lightning:bf16-mixed", "mptrain:bf16-master", "lightning+compile:bf16-mixed",
                    "mptrain+compile+cuda_graphs:bf16-master", "mptrain+compile:fp8-master"]


@pytest.mark.slow
def test_quick_user_models_write_throughput_and_memory_fields(tmp_path, capsys):
    """The plain-Lightning user models train 2 steps a case on the CPU: each case has its throughput and
    the memory fields (None on the CPU), a refused feature its reason, and the summary its two targets."""
    out = tmp_path / "user.json"
    rc = e2e.main(["--quick", "--models", ",".join(e2e.USER_MODELS), "--cases", ",".join(USER_QUICK_CASES),
                   "--warmup", "1", "--steps", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    results = {(r["model"], r["case"]): r for r in data["results"]}
    assert set(results) == {(m, c) for m in e2e.USER_MODELS for c in USER_QUICK_CASES
                            if m == "user_llama" or "fp8" not in c}
    errors = {k: r["message"] for k, r in results.items() if r["status"] == "error"}
    assert not errors and rc == 0, errors
    for key, r in results.items():
        for field in ("samples_per_s", "step_ms", "peak_mem_gb", "mem_start_gb", "mem_end_gb", "mem_phases"):
            assert field in r, (key, field)
        if key[1].endswith("cuda_graphs:bf16-master"):  # the CPU refuses CUDA graphs: the reason, no timing
            assert r["status"] == "not supported" and "cuda" in r["message"] and r["samples_per_s"] is None
        elif key[1].endswith("fp8-master"):  # and fp8 GEMMs: the trainer's reason, before the model is built
            assert r["status"] == "not supported" and "fp8 tensor cores" in r["message"] and r["batch"] == 0
        else:
            assert r["status"] == "ok" and r["samples_per_s"] > 0 and r["step_ms"] > 0, key
            assert r["peak_mem_gb"] is None and r["mem_phases"] is None  # CUDA-only measurements
    assert results[("user_resnet50", "mptrain:bf16-master")]["batch"] == 2
    for model in e2e.USER_MODELS:
        summary = data["summary"][model]
        assert summary["ratios"]["mptrain_best / lightning_compile_best"] > 0
        assert summary["ratios"]["peak mptrain:bf16-master / lightning:bf16-mixed"] is None  # no CUDA peak
        assert f"{model}: speed: mptrain best" in printed and f"{model}: memory:" in printed
    assert "img/s" in printed and "seq/s" in printed


def test_user_models_run_their_own_case_list_and_bad_cases_name_it(capsys):
    args = e2e.parse_args(["--models", "bert,user_bert"])
    fp8 = "mptrain+compile:fp8-master"  # the Llama's alone: BERT-base's and ResNet's linears are too narrow
    assert args.cases["user_bert"] == [n for n in e2e.USER_CASES if n != fp8] and args.cases["bert"] == list(e2e.CASES)
    assert all(s.optimizer == "user" for s in e2e.USER_CASES.values())
    assert fp8 in e2e.parse_args(["--models", "user_llama"]).cases["user_llama"]
    args = e2e.parse_args(["--models", "user_bert", "--cases", "mptrain:bf16-master,lightning+compile:bf16-true"])
    assert args.cases["user_bert"] == ["mptrain:bf16-master", "lightning+compile:bf16-true"]  # the list's order
    with pytest.raises(SystemExit):
        e2e.parse_args(["--models", "user_bert", "--cases", "mptrain:16-master"])
    err = capsys.readouterr().err
    assert "none of mptrain:16-master is a case of user_bert" in err and "mptrain+compile:bf16-mixed" in err


def test_user_summary_compares_speed_with_compile_and_own_peak_memory():
    def res(case, rate=None, peak=None, start=0.0, status="ok"):
        return e2e.Result("user_bert", case, "x", 128, status=status, samples_per_s=rate, peak_mem_gb=peak,
                          mem_start_gb=start)

    results = [res("lightning:bf16-mixed", 100.0, 12.0), res("mptrain:bf16-master", 95.0, 11.5, start=0.5),
               res("lightning+compile:bf16-mixed", 120.0, 10.0), res("lightning+compile:bf16-true", 110.0, 9.0),
               res("mptrain+compile:bf16-master", 130.0, 9.5),
               res("mptrain+compile+cuda_graphs:bf16-master", status="not supported"),
               res("lightning:bf16-true", 104.0, 12.6)]
    summary = e2e.summarize_user(results, "user_bert")
    assert summary["mptrain_best"]["case"] == "mptrain+compile:bf16-master"
    assert summary["lightning_compile_best"]["case"] == "lightning+compile:bf16-mixed"
    assert summary["lightning_best"]["case"] == "lightning:bf16-true"
    ratios = summary["ratios"]
    assert ratios["mptrain_best / lightning_compile_best"] == pytest.approx(130 / 120)
    assert ratios["peak mptrain:bf16-master / lightning:bf16-mixed"] == pytest.approx(11.0 / 12.0)  # own peaks
    assert ratios["peak mptrain+compile:bf16-master / lightning+compile:bf16-mixed"] == pytest.approx(0.95)
    line = e2e.format_user_summary("user_bert", summary)
    assert "= 1.083x (target >= 1.05)" in line and "11.00 GB / lightning:bf16-mixed peak 12.00 GB = 0.917" in line


def test_memory_phases_record_each_phase_and_keep_the_case_peak(monkeypatch):
    """One batch's phases on a fake CUDA allocator: each phase's peak and what it leaves allocated; the case's
    peak still counts the peak before the measured batch, which the per-phase resets cleared."""
    state = {"alloc": 0, "peak": 0}

    def alloc(n):
        state["alloc"] += n
        state["peak"] = max(state["peak"], state["alloc"])

    monkeypatch.setattr(e2e.torch.cuda, "memory_allocated", lambda: state["alloc"])
    monkeypatch.setattr(e2e.torch.cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(e2e.torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=state["alloc"]))
    gb = e2e.GB
    phases = e2e.MemoryPhases(step=2, cuda=True)
    alloc(9 * gb)  # the first batch's peak, e.g. a compile
    alloc(-7 * gb)
    phases.on_train_batch_start(None, None, None, 0)
    phases.on_train_batch_end(None, None, None, None, 0)  # the first batch: not measured
    assert phases.gb == {}
    phases.on_train_batch_start(None, None, None, 1)
    alloc(5 * gb)
    alloc(-1 * gb)
    phases.on_before_backward(None, None, None)
    alloc(2 * gb)
    alloc(-4 * gb)
    phases.on_after_backward(None, None)
    alloc(3 * gb)
    alloc(-3 * gb)
    phases.on_train_batch_end(None, None, None, None, 1)
    assert phases.gb == {"start": 2.0, "forward_peak": 7.0, "after_forward": 6.0, "backward_peak": 8.0,
                         "after_backward": 4.0, "optimizer_peak": 7.0, "after_optimizer": 4.0}
    assert phases.peak() == 9 * gb


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mptrain:bf16-master", "lightning:bf16-mixed"])
def test_memory_phases_see_every_phase_of_a_real_step(monkeypatch, case):
    """Inside a real fit (either trainer): the forward, backward and optimizer phases each report (fake CUDA
    counters; the measured step is the second of the quick run's two)."""
    monkeypatch.setattr(e2e.torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(e2e.torch.cuda, "max_memory_allocated", lambda: 0)
    monkeypatch.setattr(e2e.torch.cuda, "reset_peak_memory_stats", lambda: None)
    made = []
    init = e2e.MemoryPhases.__init__

    def on_cuda(self, step, cuda):
        init(self, 2, True)
        made.append(self)

    monkeypatch.setattr(e2e.MemoryPhases, "__init__", on_cuda)
    assert e2e.run_case("user_bert", case, case.split(":")[1], 1, 1, True).status == "ok"
    assert set(made[0].gb) == {"start", "forward_peak", "after_forward", "backward_peak", "after_backward",
                               "optimizer_peak", "after_optimizer"}
