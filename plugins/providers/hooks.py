"""Built-in model providers, registered through the same hook as third-party ones."""
from cbtrace.hookspecs import hookimpl


def _lazy(module: str, cls: str):
    def factory(**kwargs):
        import importlib

        return getattr(importlib.import_module(module), cls)(**kwargs)

    factory.__doc__ = f"{module}.{cls}"
    return factory


@hookimpl
def register_models(register):
    register("nanogpt", _lazy("cbtrace.plugins.providers.nanogpt", "NanoGPTProvider"))
    register("dlrm", _lazy("cbtrace.plugins.providers.dlrm", "DLRMProvider"))
    register("dcn", _lazy("cbtrace.plugins.providers.dcn", "DCNProvider"))
    register("hstu", _lazy("cbtrace.plugins.providers.hstu", "HSTUProvider"))
    register("torchrec", _lazy("cbtrace.plugins.providers.torchrec_dlrm", "TorchRecDeepFMProvider"))
