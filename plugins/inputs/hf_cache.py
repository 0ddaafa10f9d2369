"""transformers Cache objects (DynamicCache, StaticCache, EncoderDecoderCache, layers), duck-typed.

transformers 5 passes a Cache between modules in every plain forward (use_cache defaults to
on), so each decoder layer and attention module of a Llama, GPT-2 or T5 receives one. Any
object whose class lives in ``transformers.cache_utils`` is stored as its attribute dict
(``layers``, ``layer_class_to_replicate``, ``offloading``; a layer's ``keys``, ``values``,
``is_initialized``, ``cumulative_length`` ...) and rebuilt with ``cls.__new__`` without calling
``__init__``, as the torchrec serializer does; class references held in attributes are stored
by name. transformers is not imported to encode, only to decode such a node.

A run directory is untrusted data: decoding looks a class up in ``transformers.cache_utils``
and nowhere else, and refuses a node naming any other module or a name that is not a class
defined there.
"""
from __future__ import annotations

from cbtrace.errors import SerializationError
from cbtrace.store.serializer import Serializer, lookup_class, qualname_of

MODULE = "transformers.cache_utils"


def _cache_class(spec) -> type:
    """The class ``spec`` ("transformers.cache_utils:Name") names; SerializationError otherwise.
    Only that module's own classes, through the store's one lookup rule (never a
    ``transformers`` folder in the working directory or a run directory)."""
    module, _, name = str(spec).partition(":")
    if module != MODULE or not name.isidentifier():
        raise SerializationError(f"transformers cache node names {spec!r}, not a class of "
                                 f"{MODULE}; refusing to load it")
    return lookup_class(f"{MODULE}:{name}", modules=(MODULE,))


class HFCacheSerializer(Serializer):
    """An instance of a ``transformers.cache_utils`` class: its attribute dict, as is."""

    by_type = True  # handles() looks at type(obj) only
    name = "hf_cache"
    modules = (MODULE,)  # the one module its nodes name

    def handles(self, obj):
        return type(obj).__module__ == MODULE  # a class's type is its metaclass: never here

    def encode(self, obj, ctx):
        state = {k: ctx.encode(v) for k, v in vars(obj).items()}
        return {"cls": qualname_of(type(obj)), "state": state}

    def decode(self, node, ctx):
        cls = _cache_class(node.get("cls"))
        obj = cls.__new__(cls)
        obj.__dict__.update({k: ctx.decode(v) for k, v in node["state"].items()})
        return obj


class HFCacheClassSerializer(Serializer):
    """A class of ``transformers.cache_utils`` held as a value (``layer_class_to_replicate``).

    Not ``by_type``: the type of a class is its metaclass (``type``, ``ABCMeta``), shared
    with every other class, so the codec must not cache this answer by type. Registered last,
    so it is asked only about objects no other serializer takes.
    """

    name = "hf_cache_class"
    modules = (MODULE,)

    def handles(self, obj):
        return isinstance(obj, type) and obj.__module__ == MODULE

    def encode(self, obj, ctx):
        return {"cls": qualname_of(obj)}

    def decode(self, node, ctx):
        return _cache_class(node.get("cls"))
