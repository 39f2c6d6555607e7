"""Kernel choice by measurement (glance_rt.models.kernels): the choice logic with an injected timer
(deterministic), the per-machine cache (hit, miss, stale, unreadable), and tokens equal to HF greedy
whichever kernels are chosen."""

import json
from fractions import Fraction

import pytest
import torch
from torch import nn

import glance_rt
from glance_rt import GlanceError
from glance_rt.models import kernels as K
from glance_rt.models.kernels import KernelPlan, KernelTuner, kernel_summary, nearest_class
from glance_rt.models.linear import PackedLinear, TransposedLinear, can_pack
from tests.conftest import hf_greedy, tiny_target
from tests.tiny_models import make_inputs

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="needs a CPU build with oneDNN (mkldnn)")


class FakeTimer:
    """Deterministic timings: oneDNN wins where `onednn_wins(out, in, rows)`, else MKL over the
    transposed weight where `transposed_wins(...)`; records every call."""

    def __init__(self, onednn_wins, transposed_wins=lambda o, i, r: False):
        self.onednn_wins, self.transposed_wins, self.calls = onednn_wins, transposed_wins, []

    def __call__(self, out_f, in_f, rows, dtype):
        self.calls.append((out_f, in_f, rows))
        return {"mkl": 1.0, "mkl_t": 0.7 if self.transposed_wins(out_f, in_f, rows) else 3.0,
                "onednn": 0.5 if self.onednn_wins(out_f, in_f, rows) else 2.0}


def plan_wins(key, runs):  # a pass timer in which every pass keeps the kernels its layers chose
    return {"plan": 1.0, "plain": 2.0}


class FakePassTimer:
    """Deterministic pass timings: the plan is slower than plain for keys starting with one of `slow`;
    runs each way once (the probes must run) and records the keys."""

    def __init__(self, *slow: str):
        self.slow, self.keys = slow, []

    def __call__(self, key, runs):
        self.keys.append(key)
        for run in runs.values():
            run()
        return {"plan": 3.0 if key.startswith(self.slow) else 1.0, "plain": 2.0}


def mixed(out_f, in_f, rows):  # oneDNN for some shapes at some row counts only
    return (out_f + rows) % 2 == 1


def mixed_transposed(out_f, in_f, rows):  # MKL over the transposed weight for some others
    return (out_f + rows) % 3 == 0


def test_choice_needs_the_margin_and_prefers_the_plain_kernel_on_a_tie():
    t = KernelTuner(cache=False, margin=0.05)
    assert t.choose({"mkl": 1.0, "onednn": 0.9}) == "onednn"
    assert t.choose({"mkl": 1.0, "onednn": 0.96}) == "mkl"  # faster, but within the margin
    assert t.choose({"mkl": 1.0, "onednn": 1.0}) == "mkl"
    assert t.choose({"mkl": 1.0, "onednn": 3.0}) == "mkl"
    assert t.choose({"mkl": 1.0, "mkl_t": 0.6, "onednn": 0.9}) == "mkl_t"  # the fastest of three
    assert t.choose({"mkl": 1.0, "mkl_t": 0.97, "onednn": 1.2}) == "mkl"
    assert t.choose({"mkl": 1.0, "mkl_t": 0.5, "onednn": 0.5}) == "mkl_t"  # a tie: the first in KERNELS


def test_nearest_class_is_log_scale():
    assert nearest_class(1, (1, 9, 64)) == 1
    assert nearest_class(2, (1, 9, 64)) == 1
    assert nearest_class(4, (1, 9, 64)) == 9
    assert nearest_class(20, (1, 9, 64)) == 9  # the boundary is the geometric mean, 24
    assert nearest_class(30, (1, 9, 64)) == 64
    assert nearest_class(500, (1, 9, 64)) == 64


def test_class_index_is_the_nearest_class_in_log_scale():
    def reference(rows, classes):  # |log rows - log c| = log(max/min): compare the ratios exactly
        return min(classes, key=lambda c: (Fraction(max(rows, c), min(rows, c)), c))

    for classes in ((1,), (9,), (1, 9), (1, 9, 64), (5, 9, 17, 33, 64), (1, 8, 64)):
        for rows in range(1, 300):
            want = reference(rows, classes)
            assert classes[K.class_index(rows, classes)] == nearest_class(rows, classes) == want, (classes, rows)
    assert nearest_class(24, (64, 9, 1)) == 9  # 24 = sqrt(9 * 64): a tie goes to the smaller class


def plan_of(onednn_wins, transposed_wins=lambda o, i, r: False, classes=(9, 64), layout=9):
    return KernelPlan(layout, classes, KernelTuner(FakeTimer(onednn_wins, transposed_wins), cache=False))


def test_plan_builds_the_module_each_choice_needs():
    lin = nn.Linear(16, 24)
    assert plan_of(lambda o, i, r: False).linear(lin, 9) is lin  # MKL: the module itself
    assert isinstance(plan_of(lambda o, i, r: True).linear(lin, 9), PackedLinear)
    assert isinstance(KernelPlan(9).linear(lin, 1), PackedLinear)  # no tuner: oneDNN everywhere (prepack=True)
    assert KernelPlan(9).row_classes() == (9,)
    plan = plan_of(lambda o, i, r: r == 64, lambda o, i, r: r == 1, classes=(1, 9, 64))
    assert plan.row_classes() == (1, 9, 64) and plan.kernels(lin.weight) == {1: "mkl_t", 9: "mkl", 64: "onednn"}
    assert isinstance(plan.linear(lin, 1), TransposedLinear)
    assert plan.linear(lin, 5) is lin and plan.linear(lin, 12) is lin  # the nearest class: 9
    assert isinstance(plan.linear(lin, 300), PackedLinear)
    assert plan.linear(lin, 64) is plan.linear(lin, 40)  # one layout per weight and kernel, shared
    other = nn.Linear(16, 24)
    assert plan.linear(other, 64) is not plan.linear(lin, 64)
    assert KernelPlan(9).linear(nn.Linear(4, 4).bfloat16(), 9).weight.dtype == torch.bfloat16  # not packable: as is


def test_kernel_summary_names_one_kernel_or_one_per_class():
    lin, head = nn.Linear(64, 96), nn.Linear(64, 200)
    plan = plan_of(lambda o, i, r: r == 64 and o == 96, lambda o, i, r: r == 1, classes=(1, 64), layout=1)
    by_class = {rows: [nn.ModuleList([plan.linear(lin, rows), plan.linear(head, rows)])] for rows in (1, 9, 64)}
    assert kernel_summary(by_class) == {"96x64": {1: "mkl_t", 9: "onednn", 64: "onednn"},
                                        "200x64": {1: "mkl_t", 9: "mkl", 64: "mkl"}}
    assert kernel_summary({9: [lin], 64: [lin]}) == {"96x64": "mkl"}


@pytest.mark.parametrize("rows", [1, 2, 9, 40, 300])
def test_decoder_runs_the_stack_of_its_row_count(rows):
    """Each row class has its own layer stack (no per-layer dispatch); a pass of `rows` rows runs the
    stack of the nearest class, whose kernels are the plan's for that class, and computes the same."""
    from glance_rt.models.target import TargetDecoder

    target, model, _ = tiny_target("llama")
    plan = plan_of(lambda o, i, r: r == 64, lambda o, i, r: r == 1, classes=(1, 9, 64))
    dec, plain = (TargetDecoder(target.parts, 320, (0,), plan=p) for p in (plan, None))
    assert dec.row_classes == (1, 9, 64) and len(dec.stacks) == len(dec.heads) == 3
    q = [stack[0].self_attn.q_proj for stack in dec.stacks]
    assert isinstance(q[0], TransposedLinear) and isinstance(q[1], nn.Linear) and isinstance(q[2], PackedLinear)
    ran = []
    for i, stack in enumerate(dec.stacks):
        stack[0].register_forward_pre_hook(lambda m, args, i=i: ran.append(i))
    torch.manual_seed(0)
    x = torch.randn(1, rows, target.parts.text_config.hidden_size)
    pos, start, mask = torch.arange(rows)[None], torch.tensor(0), torch.ones(rows, rows, dtype=torch.bool).tril()
    with torch.no_grad():
        got, want = (d(x, pos, start, mask, rows) for d in (dec, plain))
    assert ran == [(1, 9, 64).index(K.nearest_class(rows, (1, 9, 64)))]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias", [True, False])
def test_transposed_linear_is_linear(bias):
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias)
    t = TransposedLinear(lin.weight, lin.bias)
    for shape in ((1, 1, 48), (1, 9, 48), (3, 48)):
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(t(x), lin(x), rtol=1e-5, atol=1e-5)
    assert kernel_summary({1: [t]}) == {"80x48": "mkl_t"}


def test_cache_hit_miss_stale_and_unreadable(tmp_path, monkeypatch, capsys):
    path = tmp_path / "kernels.json"
    first = FakeTimer(mixed)
    reqs = [(24, 16, 9, torch.float32), (24, 16, 64, torch.float32)]
    got = KernelTuner(first, cache=path).timings(reqs)
    assert len(first.calls) == 2 and path.exists()
    assert "timing kernels (once per machine)" in capsys.readouterr().err  # a bar while it times
    again = FakeTimer(mixed)  # hit: another tuner on the same file times nothing
    assert KernelTuner(again, cache=path).timings(reqs) == got and again.calls == []
    assert "timing" not in capsys.readouterr().err
    miss = FakeTimer(mixed)  # miss: only the new shape is timed
    KernelTuner(miss, cache=path).timings([*reqs, (8, 16, 9, torch.float32)])
    assert miss.calls == [(8, 16, 9)]
    real = K.machine()
    monkeypatch.setattr(K, "machine", lambda: {**real, "torch": "0.0-other"})  # stale: a library changed
    stale = FakeTimer(mixed)
    KernelTuner(stale, cache=path).timings(reqs)
    assert len(stale.calls) == 2
    assert len(json.loads(path.read_text())["machines"]) == 2  # both machines' timings kept, each under its key
    data = json.loads(path.read_text())
    for entry in data["machines"].values():
        entry["timings"] = {k: {"mkl": "fast"} for k in entry["timings"]}  # malformed entries: re-timed
    path.write_text(json.dumps(data))
    malformed = FakeTimer(mixed)
    KernelTuner(malformed, cache=path).timings(reqs)
    assert len(malformed.calls) == 2
    path.write_text("{not json")  # unreadable: re-timed and rewritten
    broken = FakeTimer(mixed)
    KernelTuner(broken, cache=path).timings(reqs)
    assert len(broken.calls) == 2 and json.loads(path.read_text())["format"] == K.CACHE_FORMAT


def test_real_timer_times_both_kernels():
    t = K.time_linear(32, 16, 4, torch.float32, budget_s=0.001)
    assert set(t) == set(K.KERNELS) and all(v > 0 for v in t.values())
    m = K.machine()
    assert m["cpu"] and m["cores"] >= 1 and m["torch"] == torch.__version__


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("plan", ["mixed", "mkl", "onednn", "mkl_t", "auto"])
def test_tokens_are_hf_greedy_whichever_kernels_are_chosen(arch, plan, tmp_path):
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor)
    ref = hf_greedy(model, inputs, 24)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    never, always = (lambda o, i, r: False), (lambda o, i, r: True)
    wins = {"mixed": (mixed, mixed_transposed), "mkl": (never, never), "onednn": (always, never),
            "mkl_t": (never, always)}.get(plan)
    prepack = "auto" if wins is None else KernelTuner(FakeTimer(*wins), cache=tmp_path / "k.json", pass_timer=plan_wins)
    dec = glance_rt.Decoder(target, drafter, tree_budget=6, lookup=0, prepack=prepack)
    assert dec.generate(max_new_tokens=24, **inputs).token_ids == ref
    kinds = {k for pass_ in dec.kernel_choices.values() for v in pass_.values()
             for k in (v.values() if isinstance(v, dict) else [v])}
    if plan == "mixed":
        assert kinds == {"mkl", "mkl_t", "onednn"}
        assert len(dec.verifier.stacks) > 1  # a stack per row class
    elif plan in ("mkl", "onednn", "mkl_t"):
        assert kinds == {plan}
    ar = glance_rt.Decoder(target, None, prepack=prepack)  # one-row autoregression: its own row class
    assert ar.generate(max_new_tokens=24, **inputs).token_ids == ref


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_a_pass_slower_with_its_kernels_runs_torchs_own_at_that_class(arch, tmp_path):
    """The pass-level check (glance_rt.round.passcheck): where the whole pass with the per-layer
    choices is slower than with torch's own linear everywhere (the injected pass timer says so for
    the verify pass's prefill class), that class runs torch's own; the other classes keep their
    kernels; the tokens stay HF greedy; the verdicts are cached per machine."""
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    passes = FakePassTimer(f"verify@{K.PREFILL_ROWS}:")
    cache = tmp_path / "k.json"
    tuner = KernelTuner(FakeTimer(lambda o, i, r: True), cache=cache, pass_timer=passes)
    dec = glance_rt.Decoder(target, drafter, tree_budget=6, lookup=0, prepack=tuner)
    # verify at 1 row: the draft gate's autoregressive steps
    assert sorted(k.split(":")[0] for k in passes.keys) == ["draft@4", "draft@64", "verify@1", "verify@64", "verify@7"]
    verify = dec.kernel_choices["verify"]
    assert verify and all(v == {1: "onednn", 7: "onednn", K.PREFILL_ROWS: "mkl"} for v in verify.values())
    assert set(dec.kernel_choices["draft"].values()) == {"onednn"}
    assert dec.generate(max_new_tokens=24, **inputs).token_ids == hf_greedy(model, inputs, 24)
    again = FakePassTimer()  # another tuner on the same cache file: the verdicts are read, not re-timed
    dec2 = glance_rt.Decoder(target, drafter, tree_budget=6, lookup=0,
                             prepack=KernelTuner(FakeTimer(lambda o, i, r: True), cache=cache, pass_timer=again))
    assert again.keys == [] and dec2.kernel_choices == dec.kernel_choices
    data = json.loads(cache.read_text())
    assert all(len(m["passes"]) == 5 for m in data["machines"].values())


def test_a_pass_that_runs_torchs_own_linear_is_not_timed(tmp_path):
    target, _, _ = tiny_target("llama")
    passes = FakePassTimer()
    tuner = KernelTuner(FakeTimer(lambda o, i, r: False), cache=tmp_path / "k.json", pass_timer=passes)
    dec = glance_rt.Decoder(target, None, prepack=tuner)
    assert passes.keys == [] and set(dec.kernel_choices["verify"].values()) == {"mkl"}


def test_a_pass_keeps_its_kernels_only_when_faster_by_the_margin():
    t = KernelTuner(cache=False, pass_margin=0.01)
    assert t.keeps_plan({"plan": 0.98, "plain": 1.0})
    assert not t.keeps_plan({"plan": 0.995, "plain": 1.0})  # faster, but within the margin
    assert not t.keeps_plan({"plan": 1.0, "plain": 1.0})
    assert not t.keeps_plan({"plan": 1.2, "plain": 1.0})


def test_pass_key_names_the_modules_and_their_kernels():
    lin, other = nn.Linear(16, 24), nn.Linear(16, 24)
    packed = plan_of(lambda o, i, r: True).linear(lin, 9)
    assert K.pass_key("p", [lin]) == K.pass_key("p", [other])  # the same structure: the same key
    assert K.pass_key("p", [lin]) != K.pass_key("p", [packed])  # another kernel
    assert K.pass_key("p", [lin]) != K.pass_key("p", [nn.Linear(16, 32)])  # another shape
    assert K.pass_key("p", [lin]) != K.pass_key("p", [lin, other])  # more layers
    assert K.pass_key("p", [lin]) != K.pass_key("p", [nn.Linear(16, 24).bfloat16()])  # another dtype
    assert K.pass_key("p", [lin]).startswith("p:") and K.pass_key("q", [lin]) != K.pass_key("p", [lin])


def test_real_pass_timer_times_both_ways():
    t = K.time_pass("k", {"plan": lambda: torch.ones(8) @ torch.ones(8), "plain": lambda: None}, budget_s=0.001)
    assert set(t) == {"plan", "plain"} and all(v > 0 for v in t.values())


def test_prepack_settings():
    target, _, _ = tiny_target("llama")
    assert glance_rt.Decoder(target, None, prepack=False).kernel_choices == {}
    forced = glance_rt.Decoder(target, None, prepack=True).kernel_choices["verify"]
    assert set(forced.values()) == {"onednn"}
    with pytest.raises(GlanceError, match="prepack="):
        glance_rt.Decoder(target, None, prepack="fast")


@pytest.mark.parametrize("onednn_faster,flavor", [(True, "frozen"), (False, "shared")])
def test_aoti_flavor_is_chosen_by_measurement(onednn_faster, flavor, tmp_path):
    from glance_rt.engines.engine import choose_flavor

    target, _, _ = tiny_target("llama")
    timer = FakeTimer(lambda o, i, r: onednn_faster)
    got, graphs, record = choose_flavor("aoti", None, target, None, [4, 8], False, 16,
                                        KernelTuner(timer, cache=tmp_path / "k.json"))
    assert got == flavor and record["chosen_by"] == "measurement"
    assert graphs == record["graphs"] == dict.fromkeys(["prefill", "verify-5", "verify-9"], flavor)
    assert {r for _, _, r in timer.calls} == {1, 5, 9, K.PREFILL_ROWS}  # each graph's rows (prefill's head: 1)
    assert record["machine"]["cpu"] == K.cpu_model()
    user, graphs, record = choose_flavor("aoti", "shared", target, None, [8], False, 16)
    assert user == "shared" and graphs is None and record["chosen_by"] == "user"
    assert choose_flavor("onnxruntime", None, target, None, [8], False, 16)[0] == "portable"


def test_aoti_flavor_weighs_only_the_kernels_a_flavor_runs(tmp_path):
    """MKL over transposed weights is no engine flavor: however fast, it picks neither."""
    from glance_rt.engines.engine import choose_flavor

    target, _, _ = tiny_target("llama")
    for onednn, flavor in ((lambda o, i, r: False, "shared"), (lambda o, i, r: True, "frozen")):
        timer = FakeTimer(onednn, lambda o, i, r: True)
        got, _, record = choose_flavor("aoti", None, target, None, [8], False, 16,
                                       KernelTuner(timer, cache=tmp_path / f"{flavor}.json"))
        assert got == flavor and all(set(t) == {"mkl", "onednn"} for t in record["linear_seconds"].values())


def test_aoti_flavor_per_graph_is_mixed_where_the_graphs_differ(tmp_path):
    from glance_rt.engines.engine import choose_flavor

    target, _, _ = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=0)
    timer = FakeTimer(lambda o, i, r: r == 4)  # oneDNN wins at the draft block's rows alone
    got, graphs, record = choose_flavor("aoti", None, target, drafter, [8], False, 16,
                                        KernelTuner(timer, cache=tmp_path / "k.json"))
    assert got == "mixed" and graphs == {"prefill": "shared", "verify-9": "shared", "context": "shared",
                                         "draft": "frozen"}


def test_engine_built_on_another_cpu_warns():
    from glance_rt.engines.engine import check_machine

    here = {"kernels": {"machine": {"cpu": K.cpu_model()}}, "flavor": "frozen"}
    assert check_machine("e", here) is None and check_machine("e", {"flavor": "shared"}) is None
    msg = check_machine("e", {"kernels": {"machine": {"cpu": "Some Other CPU 9000"}}, "flavor": "frozen"})
    assert "Some Other CPU 9000" in msg and "rebuild it here" in msg


def test_training_precision_is_measured():
    from glance_rt.tools.training.loop import use_bf16

    cpu = torch.device("cpu")
    assert use_bf16(cpu, 8, 16, timer=lambda dt: 1.0 if dt == torch.bfloat16 else 2.0)
    assert not use_bf16(cpu, 8, 16, timer=lambda dt: 6.0 if dt == torch.bfloat16 else 1.0)
    assert use_bf16(cpu, 16, 64, rows=8) in (True, False)  # the real timer runs


def test_an_unwritable_cache_warns_and_still_chooses(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder should be: the write fails
    with pytest.warns(glance_rt.GlanceWarning, match="kernel timing cache"):
        got = KernelTuner(FakeTimer(mixed), cache=blocker / "kernels.json").timings([(3, 4, 1, torch.float32)])
    assert got[(3, 4, 1, torch.float32)] == {"mkl": 1.0, "mkl_t": 3.0, "onednn": 2.0}


def test_bench_names_every_kernel_it_was_given():
    from glance_rt.tools.bench import kernel_line

    line = kernel_line({"verify": {"8x8": "mkl", "9x8": {1: "mkl_t", 9: "onednn"}, "7x8": "onednn"},
                        "draft": {"8x8": "mkl"}})
    assert line == ("verify: oneDNN for 9x8 at 9 rows, 7x8; MKL over the transposed weight for 9x8 at 1 rows "
                    "(2 of 3 shapes; the rest torch's own); draft: none (0 of 1 shapes; the rest torch's own)")


@pytest.mark.parametrize("kernel,cls", [("mkl", nn.Linear), ("mkl_t", TransposedLinear), ("onednn", PackedLinear)])
def test_kernel_module_computes_the_linear_with_its_kernel(kernel, cls):
    torch.manual_seed(0)
    lin = nn.Linear(40, 56)
    m = K.kernel_module(kernel, lin, 9)
    assert type(m) is cls and (m is lin) == (kernel == "mkl")  # torch's own: the layer as it is
    x = torch.randn(2, 5, 40)
    with torch.no_grad():
        torch.testing.assert_close(m(x), lin(x), rtol=1e-5, atol=1e-5)


def test_kernel_module_refuses_an_unknown_kernel():
    with pytest.raises(ValueError, match="unknown kernel"):
        K.kernel_module("cublas", nn.Linear(4, 4), 9)
