"""Built-in input serializers, registered through the same hook as third-party ones."""
from cbtrace.hookspecs import hookimpl


@hookimpl
def register_serializers(register):
    # imported here: torch must not load when the plugin manager starts (cbtrace --help)
    from cbtrace.plugins.inputs.builtin import SERIALIZERS
    from cbtrace.plugins.inputs.kjt import TorchrecSerializer

    register(TorchrecSerializer())
    for s in SERIALIZERS:
        register(s)
