"""The zoo: models people bring, at their libraries' default forward settings (caches on).

Each entry is a model spec for cbtrace (``benchmarks/zoo.py:hf_llama``) returning ``(model,
batch)``: random weights from a config (no hub access), ``size="tiny"`` (the default, for the
CPU suite: a few layers, d=64) or ``size="real"`` (the GPU sizes of issue 12, e.g. a ~0.5 B
Llama at batch 4 x 1024). ``-o size=real`` picks the real one from the CLI. torchvision and timm
entries need those packages (the GPU image has them). ``ENTRIES`` lists every entry with the
``--step`` it is captured with.
"""
from __future__ import annotations

import torch
from torch import nn


def _ids(vocab: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _pick(size: str, tiny, real):
    if size not in ("tiny", "real"):
        raise ValueError(f"size: expected tiny or real, got {size!r}")
    return tiny if size == "tiny" else real


# --- transformers (decoder LMs get a cache at default settings) ---------------------------

def hf_gpt2(size: str = "tiny"):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg, batch, seq = _pick(size, (dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                        n_positions=64), 2, 16),
                            (dict(), 8, 1024))
    model = GPT2LMHeadModel(GPT2Config(**cfg)).eval()
    return model, {"input_ids": _ids(model.config.vocab_size, batch, seq)}


def hf_llama(size: str = "tiny"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg, batch, seq = _pick(size, (dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64), 2, 16),
                            (dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                  num_hidden_layers=24, num_attention_heads=16,
                                  num_key_value_heads=8, max_position_embeddings=2048), 4, 1024))
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()  # real: ~0.5 B parameters
    return model, {"input_ids": _ids(cfg["vocab_size"], batch, seq)}


def hf_mistral(size: str = "tiny"):
    """GQA and a sliding attention window (shorter than the sequence)."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg, batch, seq = _pick(size, (dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=1, sliding_window=8,
                                        max_position_embeddings=64), 2, 16),
                            (dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                  num_hidden_layers=16, num_attention_heads=16,
                                  num_key_value_heads=4, sliding_window=512), 4, 1024))
    model = MistralForCausalLM(MistralConfig(**cfg)).eval()
    return model, {"input_ids": _ids(cfg["vocab_size"], batch, seq)}


def hf_mixtral(size: str = "tiny"):
    """A sparse mixture of experts: the tokens' routing decides which experts run."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg, batch, seq = _pick(size, (dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64), 2, 16),
                            (dict(vocab_size=32000, hidden_size=1024, intermediate_size=1408,
                                  num_hidden_layers=8, num_attention_heads=16,
                                  num_key_value_heads=8, num_local_experts=8,
                                  num_experts_per_tok=2), 4, 1024))
    model = MixtralForCausalLM(MixtralConfig(**cfg)).eval()
    return model, {"input_ids": _ids(cfg["vocab_size"], batch, seq)}


def hf_t5(size: str = "tiny"):
    """Encoder-decoder: an EncoderDecoderCache between the decoder's layers."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg, batch, seq = _pick(size, (dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128,
                                        num_layers=2, num_heads=4), 2, 16),
                            (dict(), 16, 512))
    model = T5ForConditionalGeneration(T5Config(**cfg)).eval()
    v = model.config.vocab_size
    return model, {"input_ids": _ids(v, batch, seq), "decoder_input_ids": _ids(v, batch, seq // 2)}


def hf_t5_base(size: str = "tiny"):
    """t5-base's sizes (hf_t5 at size real is t5-small, the config's defaults)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg, batch, seq = _pick(size, (dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128,
                                        num_layers=2, num_heads=4), 2, 16),
                            (dict(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12),
                             16, 512))
    model = T5ForConditionalGeneration(T5Config(**cfg)).eval()
    v = model.config.vocab_size
    return model, {"input_ids": _ids(v, batch, seq), "decoder_input_ids": _ids(v, batch, seq // 2)}


def hf_bert(size: str = "tiny"):
    from transformers import BertConfig, BertModel

    cfg, batch, seq = _pick(size, (dict(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=128,
                                        max_position_embeddings=64), 2, 16),
                            (dict(), 16, 512))  # BERT-base
    model = BertModel(BertConfig(**cfg)).eval()
    ids = _ids(model.config.vocab_size, batch, seq)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def hf_whisper(size: str = "tiny"):
    """Encoder-decoder on audio features."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg, batch, dec = _pick(size, (dict(vocab_size=128, d_model=64, encoder_layers=2,
                                        decoder_layers=2, encoder_attention_heads=4,
                                        decoder_attention_heads=4, encoder_ffn_dim=128,
                                        decoder_ffn_dim=128, num_mel_bins=16,
                                        max_source_positions=32, max_target_positions=32,
                                        pad_token_id=0, decoder_start_token_id=1,
                                        bos_token_id=1, eos_token_id=2), 2, 8),
                            (dict(), 8, 64))  # whisper-tiny's sizes are the config's defaults
    model = WhisperForConditionalGeneration(WhisperConfig(**cfg)).eval()
    c = model.config
    feats = torch.randn(batch, c.num_mel_bins, 2 * c.max_source_positions,
                        generator=torch.Generator().manual_seed(0))
    return model, {"input_features": feats, "decoder_input_ids": _ids(c.vocab_size, batch, dec)}


def hf_wav2vec2(size: str = "tiny"):
    """Speech encoder on raw audio: a conv feature extractor, then a positional embedding by a
    grouped Conv1d (kernel 128, 16 groups) under weight norm, then transformer layers."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    cfg, batch, samples = _pick(size, (dict(hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128,
                                            conv_dim=(32, 32, 32), conv_stride=(5, 4, 2),
                                            conv_kernel=(10, 4, 2), num_conv_pos_embeddings=16,
                                            num_conv_pos_embedding_groups=4), 2, 4000),
                                (dict(), 8, 16000))  # wav2vec2-base's sizes: the defaults
    model = Wav2Vec2Model(Wav2Vec2Config(**cfg)).eval()
    audio = torch.randn(batch, samples, generator=torch.Generator().manual_seed(0))
    return model, {"input_values": audio}


def hf_vit(size: str = "tiny"):
    from transformers import ViTConfig, ViTModel

    cfg, batch = _pick(size, (dict(image_size=32, patch_size=8, hidden_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128), 2),
                       (dict(), 64))  # ViT-B/16 at 224
    model = ViTModel(ViTConfig(**cfg)).eval()
    c = model.config
    pixels = torch.randn(batch, c.num_channels, c.image_size, c.image_size,
                         generator=torch.Generator().manual_seed(0))
    return model, {"pixel_values": pixels}


# --- hand-written modules ------------------------------------------------------------------

class SmallCNN(nn.Module):
    """Conv -> BatchNorm -> ReLU(inplace=True) blocks (the ResNet pattern), pool, head."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        layers, c = [], 3
        for w in (width, 2 * width):
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w),
                       nn.ReLU(inplace=True)]
            c = w
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


def cnn(size: str = "tiny", train: bool = False):
    """``train``: BatchNorm updates its running stats, and ReLU works in place on the
    BatchNorm's output (a non-leaf that requires grad): capture with --step train."""
    width, batch, side = _pick(size, (8, 4, 16), (64, 64, 224))
    torch.manual_seed(0)
    model = SmallCNN(width).train(train)
    return model, (torch.randn(batch, 3, side, side),)


class LSTMTagger(nn.Module):
    def __init__(self, vocab=128, dim=32, hidden=48, tags=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, tags)

    def forward(self, ids):
        seq, _ = self.lstm(self.emb(ids))
        return self.out(seq)


def lstm(size: str = "tiny"):
    torch.manual_seed(0)
    return LSTMTagger().eval(), (_ids(128, *_pick(size, (2, 16), (64, 256))),)


class TiedLM(nn.Module):
    """The output projection shares the embedding's weight; one block object sits at two paths."""

    def __init__(self, vocab=128, dim=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.shared = self.block  # the same module, reachable as block and as shared
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.shared(self.block(self.emb(ids))))


def tied(size: str = "tiny"):
    torch.manual_seed(0)
    return TiedLM().eval(), (_ids(128, 2, 16),)


class Repeated(nn.Module):
    """One module called several times per step (a weight-shared refinement loop)."""

    def __init__(self, dim=32, steps=3):
        super().__init__()
        self.step = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.steps = steps

    def forward(self, x):
        for _ in range(self.steps):
            x = x + self.step(x)
        return x


def repeated(size: str = "tiny"):
    torch.manual_seed(0)
    return Repeated().eval(), (torch.randn(4, 32),)


def compiled(size: str = "tiny"):
    """A torch.compile'd model: captured running eagerly, named as the user's tree."""
    torch.manual_seed(0)
    return torch.compile(TiedLM().eval()), (_ids(128, 2, 16),)


def compiled_block(size: str = "tiny"):
    """Only one submodule compiled, as people do with a hot block."""
    torch.manual_seed(0)
    model = Repeated().eval()
    model.step = torch.compile(model.step)
    return model, (torch.randn(4, 32),)


def compiled_nanogpt(size: str = "tiny"):
    """NanoGPT (GPT-2 small at size real) under torch.compile."""
    from cbtrace.plugins.providers.nanogpt import NanoGPTProvider

    provider = NanoGPTProvider(options={"preset": _pick(size, "tiny", "gpt2")})
    model, batch = provider.model_and_batch("cpu")
    return torch.compile(model.eval()), batch


# --- GPU-only (torchvision and timm do not load beside the CPU torch wheel) ----------------

def tv_resnet50(size: str = "real"):
    import torchvision

    model = torchvision.models.resnet50().eval()
    return model, (torch.randn(_pick(size, 2, 64), 3, 224, 224),)


def timm_vit_b16(size: str = "real"):
    import timm

    model = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
    return model, (torch.randn(_pick(size, 2, 64), 3, 224, 224),)


def timm_efficientnet_b0(size: str = "real"):
    import timm

    model = timm.create_model("efficientnet_b0", pretrained=False).eval()
    return model, (torch.randn(_pick(size, 2, 64), 3, 224, 224),)


def timm_convnext_tiny(size: str = "real"):
    import timm

    model = timm.create_model("convnext_tiny", pretrained=False).eval()
    return model, (torch.randn(_pick(size, 2, 64), 3, 224, 224),)


def tv_fasterrcnn(size: str = "real", targets: bool = False):
    """A detection model: host copies and data-dependent shapes in its heads, an ImageList
    passed between its modules. ``targets``: each image with boxes and labels, as a training
    step passes them, and the model wrapped to return the sum of its losses in train mode."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_resnet50_fpn(
        weights=None, weights_backbone=None).eval()
    side, n = _pick(size, 128, 640), _pick(size, 1, 4)
    images = [torch.rand(3, side, side) for _ in range(n)]
    if not targets:
        return model, (images,)
    g = torch.Generator().manual_seed(0)
    boxes = []
    for _ in range(n):  # 3 boxes an image: corners ordered, at least a pixel wide, inside it
        xy = torch.rand(3, 2, 2, generator=g) * (side - 1)
        boxes.append(torch.cat([xy.amin(1), xy.amax(1) + 1], dim=1))
    targets = [{"boxes": b, "labels": torch.randint(1, 91, (3,), generator=g)} for b in boxes]
    return DetectionLosses(model), (images, targets)


class DetectionLosses(nn.Module):
    """A detection model's training step as its tutorials write it: the sum of the losses it
    returns in train mode (a capture's backward starts from one scalar), its outputs alone in
    eval mode."""

    def __init__(self, detector: nn.Module):
        super().__init__()
        self.detector = detector

    def forward(self, images, targets):
        out = self.detector(images, targets)
        return sum(out.values()) if isinstance(out, dict) else out


class GNN(nn.Module):
    """Two message-passing layers of torch_geometric (GCN, then GAT) with a ReLU between."""

    def __init__(self, dim: int, hidden: int, out: int):
        super().__init__()
        from torch_geometric.nn import GATConv, GCNConv

        self.conv1, self.act, self.conv2 = GCNConv(dim, hidden), nn.ReLU(), GATConv(hidden, out)

    def forward(self, x, edge_index):
        return self.conv2(self.act(self.conv1(x, edge_index)), edge_index)


def pyg_gnn(size: str = "real"):
    """A graph neural network of torch_geometric layers on a random graph."""
    g = torch.Generator().manual_seed(0)
    nodes, edges, dim = _pick(size, (64, 256, 16), (100_000, 1_000_000, 128))
    torch.manual_seed(0)
    model = GNN(dim, 256, 64).eval()
    x = torch.randn(nodes, dim, generator=g)
    return model, (x, torch.randint(0, nodes, (2, edges), generator=g))


# name -> (spec, options, --step). The CPU suite runs every entry whose needs are installed.
ENTRIES = {
    "gpt2": ("benchmarks/zoo.py:hf_gpt2", {}, "forward"),
    "llama": ("benchmarks/zoo.py:hf_llama", {}, "forward"),
    "mistral": ("benchmarks/zoo.py:hf_mistral", {}, "forward"),
    "mixtral": ("benchmarks/zoo.py:hf_mixtral", {}, "forward"),
    "t5": ("benchmarks/zoo.py:hf_t5", {}, "forward"),
    "bert": ("benchmarks/zoo.py:hf_bert", {}, "forward"),
    "whisper": ("benchmarks/zoo.py:hf_whisper", {}, "forward"),
    "vit": ("benchmarks/zoo.py:hf_vit", {}, "forward"),
    "cnn-eval": ("benchmarks/zoo.py:cnn", {}, "forward"),
    "cnn-train": ("benchmarks/zoo.py:cnn", {"train": True}, "train"),
    "lstm": ("benchmarks/zoo.py:lstm", {}, "forward"),
    "tied": ("benchmarks/zoo.py:tied", {}, "forward"),
    "repeated": ("benchmarks/zoo.py:repeated", {}, "forward"),
    "compiled": ("benchmarks/zoo.py:compiled", {}, "forward"),
    "compiled-block": ("benchmarks/zoo.py:compiled_block", {}, "forward"),
    "torchrec-deepfm": ("torchrec:tiny", {}, "forward"),
    "torchrec-dlrm": ("torchrec:tiny", {"arch": "dlrm"}, "forward"),
    "nanogpt": ("nanogpt:tiny", {}, "forward"),
    "dlrm": ("dlrm:tiny", {}, "forward"),
    "dcn": ("dcn:tiny", {}, "forward"),
    "hstu": ("hstu:tiny", {}, "forward"),
}
