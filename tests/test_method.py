"""`glance_rt.method`: one description of what to run, parsed once, with the API's defaults; the
one rule that sizes static caches to a job."""

import inspect

import pytest

import glance_rt
from glance_rt.method import DEFAULT_LOOKUP, DEFAULT_TREE_BUDGET, Method, default_backend, job_max_length


@pytest.mark.parametrize("text,want", [
    ("ar", Method(kind="ar", lookup=0)),
    ("chain@compile", Method(kind="chain", tree_budget=None, lookup=0, backend="compile")),
    ("tree-16", Method(tree_budget=16, lookup=0)),
    ("tree-16@eager", Method(tree_budget=16, lookup=0, backend="eager")),
    ("tree-8+lookup@plain", Method(tree_budget=8, lookup=DEFAULT_LOOKUP, backend="plain")),
    ("adaptive@compile", Method(kind="adaptive", lookup=0, backend="compile")),
    ("tree-8+lookup-15+always@compile", Method(tree_budget=8, lookup=DEFAULT_LOOKUP, backend="compile", gate=False,
                                               lookup_budget=15)),
    ("eagle3-16", Method(kind="eagle3", tree_budget=16, lookup=0)),
    ("eagle3-8+always@eager", Method(kind="eagle3", tree_budget=8, lookup=0, backend="eager", gate=False)),
])
def test_parse_and_name_round_trip(text, want):
    assert Method.parse(text) == want
    assert want.name == text
    assert Method.parse(want.name) == want


@pytest.mark.parametrize("text", ["tree", "tree-x", "tree-8+lookahead", "chain@tensorrt", "beam-4", "tree-8@", "eagle3",
                                  "eagle3-8+lookup",
                                  "tree-8+lookup-", "tree-8+lookup-x", "tree-8-15"])
def test_unknown_methods_are_refused(text):
    with pytest.raises(glance_rt.GlanceError, match="method|backend"):
        Method.parse(text)


def test_api_cli_and_method_share_defaults():
    """Decoder(), Method() and `glance-rt generate` / `audit` describe the same default method."""
    from glance_rt.cli import audit, generate

    default = Method()
    assert (default.kind, default.tree_budget, default.lookup, default.backend) == ("tree", DEFAULT_TREE_BUDGET,
                                                                                    None, None)
    assert default.name == f"tree-{DEFAULT_TREE_BUDGET}+lookup"
    params = inspect.signature(glance_rt.Decoder).parameters
    assert params["tree_budget"].default is None and params["lookup"].default is None  # trees: the default budget
    assert params["backend"].default == default.backend
    for command in (generate, audit):
        opts = {p.name: p for p in command.params}
        assert opts["tree_budget"].default is None and opts["lookup"].default is None  # -> the defaults above
        assert opts["lookup_budget"].default is None and params["lookup_budget"].default is None
        assert opts["backend"].default == default.backend and opts["max_length"].default is None


def test_the_default_backend_is_the_devices():
    """No backend named: compiled CUDA-graph passes on a CUDA device, eager on a CPU; a decoder's method
    name leaves out the default backend and names any other (`@eager` on a GPU), so it parses back to it."""
    import torch

    from tests.conftest import tiny_target

    assert default_backend(torch.device("cuda", 0)) == default_backend("cuda") == "compile"
    assert default_backend(torch.device("cpu")) == "eager"
    target, _, _ = tiny_target("llama")
    assert glance_rt.Decoder(target, None, max_length=64).backend.name == "eager"  # a CPU target
    assert glance_rt.Decoder.from_method(Method.parse("ar@eager"), target, max_length=64).method_name == "ar"
    assert Method.parse("ar").backend is None and Method.parse("ar@eager").backend == "eager"


def test_default_lookup_applies_to_drafter_trees_only():
    from tests.conftest import tiny_target

    target, _, _ = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, block_size=4)
    assert glance_rt.Decoder(target, drafter, max_length=128).lookup == DEFAULT_LOOKUP
    assert glance_rt.Decoder(target, drafter, chain=True, max_length=128).lookup == 0
    assert glance_rt.Decoder(target, None, max_length=128).lookup == 0
    with pytest.raises(glance_rt.GlanceError, match="lookup=3"):
        glance_rt.Decoder(target, None, lookup=3, max_length=128)
    dec = glance_rt.Decoder.from_method(Method.parse("tree-6+lookup"), target, drafter, max_length=128)
    assert (dec.tree_budget, dec.lookup, dec.chain, dec.backend.name) == (6, DEFAULT_LOOKUP, False, "eager")
    # a decoder names what it runs as Method.parse reads it
    for name in ("ar", "chain", "tree-6", "tree-6+lookup", "tree-6+lookup-6", "tree-6+lookup@plain", "ar@plain"):
        assert glance_rt.Decoder.from_method(Method.parse(name), target, drafter, max_length=128).method_name == name
    assert glance_rt.Decoder.from_method(Method.parse("ar"), target, drafter, max_length=128).drafter is None
    assert not glance_rt.Decoder.from_method(Method.parse("tree-6@plain"), target, drafter, max_length=128).prepack


def test_a_chain_drafts_the_drafters_whole_block_by_default():
    """Issue 38: a chain with no budget draws what the drafter's own runtime draws (DFlash: the whole
    block, B-1 tokens), from the API and a method name alike (the CLI: tests/test_cli.py); a budget
    caps it; trees keep DEFAULT_TREE_BUDGET."""
    from tests.conftest import tiny_target

    target, _, _ = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, block_size=16)
    assert glance_rt.Decoder(target, drafter, chain=True, max_length=128).tree_budget == 15
    assert glance_rt.Decoder(target, drafter, chain=True, tree_budget=8, max_length=128).tree_budget == 8
    assert glance_rt.Decoder(target, drafter, max_length=128).tree_budget == DEFAULT_TREE_BUDGET
    assert glance_rt.Decoder.from_method(Method.parse("chain"), target, drafter, max_length=128).tree_budget == 15
    assert Method.parse("chain").tree_budget is None and job_max_length(100, 128, [None]) == 320


def test_eagle3_methods_take_eagle3_heads():
    from glance_rt.models.eagle3 import init_eagle3
    from tests.conftest import tiny_target

    target, _, _ = tiny_target("llama")
    layers = target.text_config.num_hidden_layers
    head = init_eagle3(target, depth=3, target_layer_ids=(0, layers // 2, layers - 1))
    dec = glance_rt.Decoder.from_method(Method.parse("eagle3-6"), target, head, max_length=128)
    assert dec.method_name == "eagle3-6" and dec.tree_budget == 6 and dec.lookup == 0
    with pytest.raises(glance_rt.GlanceError, match="EAGLE-3 head"):
        glance_rt.Decoder.from_method(Method.parse("eagle3-6"), target, glance_rt.init_drafter(target), max_length=128)
    with pytest.raises(glance_rt.GlanceError, match="not an EAGLE-3 head"):
        glance_rt.Decoder.from_method(Method.parse("tree-6"), target, head, max_length=128)


def test_job_max_length():
    from glance_rt.method import MAX_SCRATCH_BLOCK
    from glance_rt.models.drafter import MAX_BLOCK_SIZE

    assert MAX_SCRATCH_BLOCK == MAX_BLOCK_SIZE  # the light module's copy of the drafter's limit
    assert job_max_length(100, 128) == 320  # 100 + 128 + a 64-row block, up to a multiple of 64
    assert job_max_length(100, 128, [8]) == 320
    assert job_max_length(100, 128, [100]) == 384  # the largest tree's 101 rows
    assert job_max_length(1, 1) == 128


def test_lookup_budget_is_a_verify_shape_within_max_depth():
    """Lookup rounds verify `lookup_budget` rows (default DEFAULT_LOOKUP_BUDGET within max_depth = 2B-1),
    one more verify shape where it is more than the tree's; a budget past max_depth, or one without
    lookup, is refused."""
    from glance_rt.method import DEFAULT_LOOKUP_BUDGET
    from tests.conftest import tiny_target

    target, _, _ = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, block_size=4)
    assert DEFAULT_LOOKUP_BUDGET >= 7
    assert glance_rt.Decoder(target, drafter, tree_budget=6, max_length=128).budgets == [0, 6, 7]
    assert glance_rt.Decoder(target, drafter, tree_budget=6, lookup_budget=6, max_length=128).budgets == [0, 6]
    assert glance_rt.Decoder(target, drafter, tree_budget=8, max_length=128).budgets == [0, 8]
    assert glance_rt.Decoder(target, drafter, tree_budget=2, lookup_budget=3, max_length=128).budgets == [0, 2, 3]
    for kw in ({"lookup_budget": 8}, {"lookup_budget": 0}, {"lookup": 0, "lookup_budget": 5}):
        with pytest.raises(glance_rt.GlanceError, match="lookup_budget"):
            glance_rt.Decoder(target, drafter, max_length=128, **kw)
