import subprocess
import sys

import pytest


def test_import_is_light_and_never_touches_cuda():
    code = (
        "import sys, glance_rt; "
        "assert 'transformers' not in sys.modules, 'transformers imported'; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "glance_rt.GlanceError; "
        "import torch; assert not torch.cuda.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lazy_names_resolve():
    import glance_rt
    from glance_rt import errors, method
    from glance_rt.hf import target
    from glance_rt.models import drafter, eagle3
    from glance_rt.round import batch, gate, loop, sample

    homes = {"load_target": target, "Target": target, "init_drafter": drafter, "load_drafter": drafter,
             "GlanceDrafter": drafter, "DrafterConfig": drafter, "init_eagle3": eagle3, "load_eagle3": eagle3,
             "Decoder": loop, "GenerateResult": loop, "Batch": batch,
             "Stats": loop, "Method": method, "GlanceError": errors, "GlanceWarning": errors, "Sampling": sample,
             "GateConfig": gate}
    assert set(glance_rt.__all__) == {*homes, "__version__"}
    for name, module in homes.items():
        assert getattr(glance_rt, name) is getattr(module, name), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = glance_rt.nope


def _module_imports() -> dict[str, set[str]]:
    """glance_rt module -> the glance_rt modules it imports anywhere in its source (function-level
    imports included: a cycle through a lazy import is still a cycle)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    folders = {"glance_rt": root / "glance_rt", "glance_rt.export": root / "export",
               "glance_rt.engines": root / "engines"}
    modules = {}
    for package, folder in folders.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            modules[name] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("glance_rt"):
                    deps.add(t)
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _module_imports()
    assert "glance_rt.round.loop" in graph and "glance_rt.engines.engine" in graph
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if dep == "glance_rt" and node.startswith("glance_rt."):
                continue  # a submodule importing its package's light __init__ (GlanceError) is no cycle
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles
