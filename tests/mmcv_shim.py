"""Make mmsegmentation importable with mmcv-lite, which has no compiled ops (``mmcv.ops``):
mmseg 1.2.2 imports a few of them at module level but its UNet, FCN and UPerNet models
never call them. Where ``mmcv.ops`` does not import, a stub stands in whose every name
raises when called. Test setup only, never the library."""

import sys
import types


def install():
    try:
        import mmcv.ops  # noqa: F401 - full mmcv: the real ops
    except ImportError:
        stub = types.ModuleType("mmcv.ops")

        def __getattr__(name):
            if name.startswith("_"):
                raise AttributeError(name)

            def missing(*args, **kwargs):
                raise NotImplementedError(f"mmcv.ops.{name}: mmcv-lite has no compiled ops")

            return missing

        stub.__getattr__ = __getattr__
        sys.modules["mmcv.ops"] = stub
