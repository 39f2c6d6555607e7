import subprocess
import sys


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

    for name in ("load_target", "init_drafter", "load_drafter", "Decoder", "GlanceError"):
        assert getattr(glance_rt, name) is not None
