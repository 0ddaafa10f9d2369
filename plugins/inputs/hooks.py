"""Built-in input serializers, registered through the same hook as third-party ones."""
from cbtrace.hookspecs import hookimpl


@hookimpl
def register_serializers(register):
    # imported here: torch must not load when the plugin manager starts (cbtrace --help)
    from cbtrace.plugins.inputs.builtin import SERIALIZERS
    from cbtrace.plugins.inputs.hf_cache import HFCacheClassSerializer, HFCacheSerializer
    from cbtrace.plugins.inputs.kjt import TorchrecSerializer
    from cbtrace.plugins.inputs.objects import PlainObjectSerializer

    register(TorchrecSerializer())
    register(HFCacheSerializer())
    for s in SERIALIZERS:
        register(s)
    register(PlainObjectSerializer())  # after the built-ins: a dataclass or namedtuple is theirs
    # last: it is not by_type, and every serializer asked before a match must be for the
    # codec to cache the answer by type (tensors are asked about thousands of times a step)
    register(HFCacheClassSerializer())
