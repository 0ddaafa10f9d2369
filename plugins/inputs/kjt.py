"""torchrec KeyedJaggedTensor, JaggedTensor and KeyedTensor, duck-typed.

torchrec is not imported here: an object is recognised by its class name and module. Its
attribute dict (``_keys``, ``_values``, ``_lengths``, cached ``_offset_per_key`` ...) is stored
as is and restored without calling ``__init__``, so lazily computed caches come back exactly
as the module saw them. Loading needs torchrec installed; the class is found through
``lookup_class``.
"""
from __future__ import annotations

from cbtrace.errors import SerializationError
from cbtrace.store.serializer import Serializer, lookup_class, qualname_of

CLASSES = ("KeyedJaggedTensor", "JaggedTensor", "KeyedTensor")


class TorchrecSerializer(Serializer):
    by_type = True  # handles() looks at type(obj) only
    name = "torchrec"
    modules = ("torchrec",)

    def handles(self, obj):
        cls = type(obj)
        return cls.__name__ in CLASSES and cls.__module__.startswith("torchrec.")

    def encode(self, obj, ctx):
        state = {k: ctx.encode(v) for k, v in vars(obj).items()}
        return {"cls": qualname_of(type(obj)), "state": state}

    def decode(self, node, ctx):
        spec = node["cls"]
        if not spec.startswith("torchrec.") or spec.rpartition(":")[2] not in CLASSES:
            raise SerializationError(f"torchrec node names an unexpected class {spec}")
        try:
            cls = lookup_class(spec, modules=self.modules)
        except SerializationError as e:
            raise SerializationError(f"loading a {spec.rpartition(':')[2]} needs torchrec "
                                     f"({e})") from None
        obj = cls.__new__(cls)
        obj.__dict__.update({k: ctx.decode(v) for k, v in node["state"].items()})
        return obj
