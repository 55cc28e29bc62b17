"""Frozen encoders that turn decoded samples into what the model trains on: the Wan VAE and a text encoder.

    VAE     diffusers `AutoencoderKLWan`; the posterior is taken at its mode; latents are normalised with the VAE's
            own statistics, z_norm = (z − latents_mean) / latents_std (as diffusers' Wan pipeline does, which
            multiplies by 1/std); fp32 by default (`data.encoders.vae_dtype: bfloat16` halves memory)
    text    pluggable (`data.encoders.text`, registry TEXT_ENCODERS): each returns per-caption embeddings of the real
            tokens [L_i, C] (the Batch zero-pads them to the model's text_len, 512 for Wan), the token mask, and a
            pooled embedding [C_pool] where the encoder has one (an MMDiT needs it; UMT5 has none)

`data.encoders.vae` may also name a PCA VAE folder (data/pca_vae.py: the same strides, linear maps fitted to a
corpus); `data.encoders.text: words` is a weightless bag of words. The demo uses both (data/shapes.py).

Both load from local folders (a diffusers model root holding vae/, text_encoder/, tokenizer/, or the component
folder itself; weights from safetensors only — a folder holding only .bin pickles is refused, never unpickled — and
no remote code) or are built tiny from config with weights seeded by `data.encoders.seed` — so two processes (the
precompute script and a training run) build identical tiny encoders. Tiny text uses the byte-level ByT5 tokenizer,
which needs no files. Heavy imports (diffusers, transformers) happen only when an encoder is built.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EncoderConfig:
    """`data.encoders`: used when a corpus holds raw images/videos (on-the-fly) and by scripts/precompute_latents.py."""
    vae: Optional[str] = None           # local folder (model root with vae/, or the vae folder); null: tiny
    vae_dtype: str = "float32"
    text: str = "umt5"                  # a key of TEXT_ENCODERS
    text_encoder: Optional[str] = None  # local folder (model root with text_encoder/, or the folder); null: tiny
    tokenizer: Optional[str] = None     # local folder; null: beside text_encoder, or byte-level ByT5 for tiny
    text_encoder_2: Optional[str] = None  # llama_clip: the CLIP text model's folder (model root with text_encoder_2/)
    tokenizer_2: Optional[str] = None     # llama_clip: CLIP's tokenizer; null: beside text_encoder_2, or ByT5 bytes
    pooled_dim: Optional[int] = None      # llama_clip, tiny CLIP: the pooled width (the MMDiT's pooled_projection_dim)
    llama_skip_layers: int = 2            # llama_clip: hidden states this many layers before the last (HunyuanVideo)
    text_dtype: str = "float32"
    max_text_len: int = 512             # tokens kept per caption (Wan: 512)
    device: str = "auto"                # auto: cuda:LOCAL_RANK when CUDA is present, else cpu
    batch_size: int = 8                 # samples per VAE call (bounds the encoder's activation memory)
    seed: int = 0                       # weights of the tiny encoders
    tiny_vae: dict = field(default_factory=lambda: {"base_dim": 8, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1})
    tiny_text: dict = field(default_factory=lambda: {"d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4})

    def __post_init__(self):
        for name in ("vae_dtype", "text_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"data.encoders.{name} must be one of {sorted(DTYPES)}, got {getattr(self, name)!r}")
        if self.text not in TEXT_ENCODERS:
            raise ValueError(f"data.encoders.text must be one of {sorted(TEXT_ENCODERS)}, got {self.text!r}")
        if self.max_text_len < 1 or self.batch_size < 1:
            raise ValueError("data.encoders.max_text_len and data.encoders.batch_size must be ≥ 1")
        if self.pooled_dim is not None and self.pooled_dim < 1:
            raise ValueError(f"data.encoders.pooled_dim must be ≥ 1 or null, got {self.pooled_dim}")
        if self.llama_skip_layers < 0:
            raise ValueError(f"data.encoders.llama_skip_layers must be ≥ 0, got {self.llama_skip_layers}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"data.encoders.seed must lie in [0, 2^64), got {self.seed}")
        for name in ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):
            path = getattr(self, name)
            if path is not None and not os.path.isdir(path):
                raise ValueError(f"data.encoders.{name}={path!r} is not a folder: give a local model folder "
                                 f"(no hub access) or null for the tiny encoder")

    def describe(self, latent_channels: int, text_dim: int) -> dict:
        """What identifies these encoders' outputs (stored with precomputed latents, compared on load)."""
        return {"vae": self.vae or {"tiny": dict(self.tiny_vae), "z_dim": latent_channels, "seed": self.seed},
                "vae_dtype": self.vae_dtype, "text": self.text, "max_text_len": self.max_text_len,
                "text_encoder": self.text_encoder or {"tiny": dict(self.tiny_text), "dim": text_dim, "seed": self.seed}}


def _component(path: str, sub: str) -> tuple[str, Optional[str]]:
    """(folder, subfolder) for from_pretrained: a model root holding `sub`/, or the component folder itself."""
    return (path, sub) if os.path.isdir(os.path.join(path, sub)) else (path, None)


def _from_pretrained(cls, folder: str, sub: str, field: str, dtype: torch.dtype):
    """cls.from_pretrained of a local component folder (`field` names its data.encoders entry), safetensors only."""
    path, subfolder = _component(folder, sub)
    where = os.path.join(path, subfolder) if subfolder else path
    if not glob.glob(os.path.join(where, "*.safetensors")):
        raise ValueError(f"data.encoders.{field}={folder!r}: {where} holds no .safetensors weights. Only safetensors "
                         f"are loaded (a .bin checkpoint is a pickle, which can run code): convert it once where you "
                         f"trust it, e.g. from_pretrained(...).save_pretrained(dir, safe_serialization=True)")
    return cls.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype, local_files_only=True,
                               use_safetensors=True)


def _place(model, dtype: torch.dtype, device: torch.device):
    """Frozen, in eval mode, on device; cast only when the dtype differs (from_pretrained already cast it)."""
    if next(model.parameters()).dtype != dtype:
        model = model.to(dtype=dtype)
    return model.to(device=device).eval().requires_grad_(False)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    return torch.device(name)


# -- VAE --------------------------------------------------------------------------------------------------------------

class WanVAE:
    """x [B, 3, F, H, W] in [−1, 1] → normalised posterior-mode latents [B, C, 1 + (F−1)/4, H/8, W/8], fp32."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        self.model = _place(model, dtype, device)
        self.dtype, self.device = dtype, device
        c = model.config.z_dim
        self.mean = torch.tensor(model.config.latents_mean, dtype=torch.float32, device=device).view(1, c, 1, 1, 1)
        self.std = torch.tensor(model.config.latents_std, dtype=torch.float32, device=device).view(1, c, 1, 1, 1)

    @property
    def latent_channels(self) -> int:
        return self.model.config.z_dim

    @torch.inference_mode()
    def encode(self, x_BCFHW: torch.Tensor) -> torch.Tensor:
        z = self.model.encode(x_BCFHW.to(self.device, self.dtype)).latent_dist.mode()
        return (z.float() - self.mean) / self.std

    def encode_u8(self, u8_BFHWC) -> torch.Tensor:
        """The same from decoded uint8 frames [B, F, H, W, 3], cast to [−1, 1] on the VAE's device."""
        from data.decode import to_model_range

        return self.encode(to_model_range(u8_BFHWC, self.device, self.dtype))

    @torch.inference_mode()
    def decode(self, z_norm_BCFHW: torch.Tensor) -> torch.Tensor:
        """Normalised latents → pixels [B, 3, 1 + 4·(F' − 1), 8·H', 8·W'] in [−1, 1], fp32 on the CPU:
        z = z_norm·std + mean (the inverse of encode's normalisation), then the VAE decoder."""
        z = z_norm_BCFHW.to(self.device, torch.float32) * self.std + self.mean
        return self.model.decode(z.to(self.dtype), return_dict=False)[0].float().clamp(-1, 1).cpu()


def build_vae(cfg: EncoderConfig, latent_channels: int, device: torch.device):
    """The VAE `data.encoders.vae` names: a diffusers Wan VAE folder (WanVAE), a PCA VAE folder (data/pca_vae.py,
    `pca_vae.safetensors`), or null for the tiny Wan VAE with seeded random weights."""
    from data.pca_vae import PCAVAE, is_pca_vae

    if cfg.vae and is_pca_vae(cfg.vae):
        vae = PCAVAE.load(cfg.vae, device)
        if vae.latent_channels != latent_channels:
            raise ValueError(f"the PCA VAE at data.encoders.vae={cfg.vae} has {vae.latent_channels} latent channels "
                             f"but the model takes in_channels={latent_channels}")
        return vae
    from diffusers import AutoencoderKLWan

    dtype = DTYPES[cfg.vae_dtype]
    if cfg.vae:
        model = _from_pretrained(AutoencoderKLWan, cfg.vae, "vae", "vae", dtype)
    else:
        g = torch.Generator().manual_seed(cfg.seed + 1)
        stats = torch.rand(2, latent_channels, generator=g)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = AutoencoderKLWan(z_dim=latent_channels, latents_mean=(stats[0] - 0.5).tolist(),
                                     latents_std=(0.5 + stats[1]).tolist(), **cfg.tiny_vae)
    if model.config.z_dim != latent_channels:
        raise ValueError(f"the VAE at {cfg.vae} has z_dim={model.config.z_dim} latent channels but the model takes "
                         f"in_channels={latent_channels}")
    return WanVAE(model, dtype, device)


# -- text -------------------------------------------------------------------------------------------------------------

@dataclass
class TextOutput:
    embeds: torch.Tensor                   # [B, L, C] padded to the batch's longest caption, fp32 CPU
    mask: torch.Tensor                     # [B, L] bool, True on real tokens
    pooled: Optional[torch.Tensor] = None  # [B, C_pool] where the encoder has one

    def per_sample(self) -> list[torch.Tensor]:
        """[L_i, C] of real tokens per caption (what a latent shard stores and the Batch pads)."""
        return [e[m] for e, m in zip(self.embeds, self.mask)]


class TextEncoder:
    """The interface a text encoder offers the data side: `dim`, `pooled_dim`, `encode(captions)`."""
    dim: int
    pooled_dim: Optional[int] = None

    def encode(self, captions: Sequence[str]) -> TextOutput:
        raise NotImplementedError


TEXT_ENCODERS: dict[str, Callable[[EncoderConfig, int, torch.device], TextEncoder]] = {}


def register_text_encoder(name: str):
    def wrap(builder):
        TEXT_ENCODERS[name] = builder
        return builder
    return wrap


class UMT5Text(TextEncoder):
    """Wan 2.1's text side: UMT5 encoder hidden states of the real tokens, as diffusers' Wan pipeline takes them."""

    def __init__(self, model, tokenizer, max_len: int, dtype: torch.dtype, device: torch.device):
        self.model = _place(model, dtype, device)
        self.tokenizer, self.max_len, self.device = tokenizer, max_len, device
        self.dim = model.config.d_model

    @torch.inference_mode()
    def encode(self, captions: Sequence[str]) -> TextOutput:
        tok = self.tokenizer(list(captions), padding="longest", truncation=True, max_length=self.max_len,
                             add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        mask = tok.attention_mask.to(self.device)
        h = self.model(tok.input_ids.to(self.device), attention_mask=mask).last_hidden_state
        return TextOutput(h.float().cpu(), mask.bool().cpu())


def _tokenizer_folder(cfg: EncoderConfig) -> str:
    if cfg.tokenizer:
        return cfg.tokenizer
    root = cfg.text_encoder.rstrip("/")
    for cand in (os.path.join(root, "tokenizer"), os.path.join(os.path.dirname(root), "tokenizer"), root):
        if os.path.exists(os.path.join(cand, "tokenizer_config.json")):
            return cand
    raise ValueError(f"no tokenizer found beside data.encoders.text_encoder={cfg.text_encoder!r}: "
                     f"set data.encoders.tokenizer to its folder")


@register_text_encoder("umt5")
def build_umt5(cfg: EncoderConfig, text_dim: int, device: torch.device) -> UMT5Text:
    from transformers import AutoTokenizer, ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    dtype = DTYPES[cfg.text_dtype]
    if cfg.text_encoder:
        model = _from_pretrained(UMT5EncoderModel, cfg.text_encoder, "text_encoder", "text_encoder", dtype)
        tokenizer = AutoTokenizer.from_pretrained(_tokenizer_folder(cfg), local_files_only=True)
    else:
        tokenizer = cfg.tokenizer and AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
        tokenizer = tokenizer or ByT5Tokenizer()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=text_dim,
                                                relative_attention_num_buckets=32, **cfg.tiny_text))
    if model.config.d_model != text_dim:
        raise ValueError(f"the text encoder at {cfg.text_encoder} has d_model={model.config.d_model} but the model "
                         f"takes text_dim={text_dim}")
    return UMT5Text(model, tokenizer, cfg.max_text_len, dtype, device)


class WordsText(TextEncoder):
    """A bag of words, for demos and tests: each word of a caption (lower-cased runs of letters and digits) is one
    token, embedded as a fixed vector of `dim` standard-normal entries drawn from a generator seeded by
    sha256(data.encoders.seed, word). Deterministic, needs no weights, and captions that differ in a word differ in
    that token — so a small model learns colour, shape and direction words in minutes (data/shapes.py). The empty
    caption is one zero token. Not a language model: word order and unseen phrasings mean nothing to it."""

    def __init__(self, dim: int, seed: int, max_len: int):
        self.dim, self.seed, self.max_len = dim, seed, max_len
        self._vectors: dict[str, torch.Tensor] = {}

    def vector(self, word: str) -> torch.Tensor:
        if word not in self._vectors:
            h = hashlib.sha256(f"{self.seed}:{word}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little"))
            self._vectors[word] = torch.randn(self.dim, generator=g)
        return self._vectors[word]

    def encode(self, captions: Sequence[str]) -> TextOutput:
        words = [re.findall(r"[a-z0-9]+", c.lower())[: self.max_len] for c in captions]
        L = max(1, max(map(len, words)))
        embeds, mask = torch.zeros(len(captions), L, self.dim), torch.zeros(len(captions), L, dtype=torch.bool)
        for i, ws in enumerate(words):
            for j, w in enumerate(ws):
                embeds[i, j] = self.vector(w)
            mask[i, : max(1, len(ws))] = True  # the empty caption: one zero token
        return TextOutput(embeds, mask)


@register_text_encoder("words")
def build_words(cfg: EncoderConfig, text_dim: int, device: torch.device) -> WordsText:
    if cfg.text_encoder:
        raise ValueError(f"data.encoders.text=words takes no weights, but data.encoders.text_encoder="
                         f"{cfg.text_encoder!r} is set: leave it null, or choose data.encoders.text=umt5")
    return WordsText(text_dim, cfg.seed, cfg.max_text_len)


class LlamaClipText(TextEncoder):
    """HunyuanVideo's text side: a LLaMA-style decoder's hidden states (`llama_skip_layers` before the last) of the
    real tokens, and a CLIP text model's pooled output (`pooler_output`, at the end-of-text token) per caption."""

    def __init__(self, llama, llama_tok, clip, clip_tok, max_len: int, skip: int, dtype: torch.dtype,
                 device: torch.device):
        self.llama, self.clip = _place(llama, dtype, device), _place(clip, dtype, device)
        self.llama_tok, self.clip_tok, self.max_len, self.skip, self.device = llama_tok, clip_tok, max_len, skip, device
        self.dim, self.pooled_dim = llama.config.hidden_size, clip.config.hidden_size
        self.clip_len = clip.config.max_position_embeddings

    @torch.inference_mode()
    def encode(self, captions: Sequence[str]) -> TextOutput:
        tok = self.llama_tok(list(captions), padding="longest", truncation=True, max_length=self.max_len,
                             return_attention_mask=True, return_tensors="pt")
        mask = tok.attention_mask.to(self.device)
        out = self.llama(tok.input_ids.to(self.device), attention_mask=mask, output_hidden_states=True)
        h = out.hidden_states[-(self.skip + 1)]
        ctok = self.clip_tok(list(captions), padding="max_length", truncation=True, max_length=self.clip_len,
                             return_tensors="pt")
        pooled = self.clip(ctok.input_ids.to(self.device)).pooler_output
        return TextOutput(h.float().cpu(), mask.bool().cpu(), pooled.float().cpu())


def _tokenizer(folder: Optional[str], model_folder: Optional[str], sub: str):
    from transformers import AutoTokenizer, ByT5Tokenizer

    if folder:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if model_folder:
        root = model_folder.rstrip("/")
        for cand in (os.path.join(root, sub), os.path.join(os.path.dirname(root), sub), root):
            if os.path.exists(os.path.join(cand, "tokenizer_config.json")):
                return AutoTokenizer.from_pretrained(cand, local_files_only=True)
        raise ValueError(f"no {sub} found beside {model_folder!r}: set its data.encoders tokenizer folder")
    return ByT5Tokenizer()


@register_text_encoder("llama_clip")
def build_llama_clip(cfg: EncoderConfig, text_dim: int, device: torch.device) -> LlamaClipText:
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    dtype = DTYPES[cfg.text_dtype]
    llama_tok = _tokenizer(cfg.tokenizer, cfg.text_encoder, "tokenizer")
    clip_tok = _tokenizer(cfg.tokenizer_2, cfg.text_encoder_2, "tokenizer_2")
    if llama_tok.pad_token is None:  # LLaMA tokenizers ship without one; padding is masked anyway
        llama_tok.pad_token = llama_tok.eos_token
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.text_encoder:
            llama = _from_pretrained(LlamaModel, cfg.text_encoder, "text_encoder", "text_encoder", dtype)
        else:
            t = cfg.tiny_text
            llama = LlamaModel(LlamaConfig(vocab_size=len(llama_tok), hidden_size=text_dim,
                                           intermediate_size=t.get("d_ff", 64),
                                           num_hidden_layers=max(cfg.llama_skip_layers + 1, t.get("num_layers", 2)),
                                           num_attention_heads=t.get("num_heads", 4),
                                           num_key_value_heads=t.get("num_heads", 4),
                                           pad_token_id=llama_tok.pad_token_id))
        if cfg.text_encoder_2:
            clip = _from_pretrained(CLIPTextModel, cfg.text_encoder_2, "text_encoder_2", "text_encoder_2", dtype)
        else:
            if cfg.pooled_dim is None:
                raise ValueError("data.encoders.pooled_dim must be set for the tiny CLIP (the MMDiT's "
                                 "pooled_projection_dim), or point data.encoders.text_encoder_2 at a CLIP folder")
            clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=cfg.pooled_dim,
                                                intermediate_size=2 * cfg.pooled_dim, num_hidden_layers=1,
                                                num_attention_heads=2, max_position_embeddings=77,
                                                bos_token_id=clip_tok.eos_token_id, eos_token_id=clip_tok.eos_token_id,
                                                pad_token_id=clip_tok.pad_token_id))
    if llama.config.hidden_size != text_dim:
        raise ValueError(f"the LLaMA text encoder has hidden_size={llama.config.hidden_size} but the model takes "
                         f"text_dim={text_dim}")
    if cfg.llama_skip_layers >= llama.config.num_hidden_layers:
        raise ValueError(f"data.encoders.llama_skip_layers={cfg.llama_skip_layers} must be below the encoder's "
                         f"{llama.config.num_hidden_layers} layers")
    return LlamaClipText(llama, llama_tok, clip, clip_tok, cfg.max_text_len, cfg.llama_skip_layers, dtype, device)


# -- both -------------------------------------------------------------------------------------------------------------

class Encoders:
    """The VAE and text encoder together, as the loader (on the fly) and the precompute script use them."""

    def __init__(self, vae: WanVAE, text: TextEncoder, batch_size: int = 8):
        self.vae, self.text, self.batch_size = vae, text, batch_size
        self._empty: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None

    def encode_pixels(self, u8_BFHWC) -> torch.Tensor:
        """Decoded uint8 frames [B, F, H, W, 3] → normalised latents [B, C, F', H', W'] on the CPU, fp32,
        `batch_size` samples per VAE call."""
        return torch.cat([self.vae.encode_u8(u8_BFHWC[i:i + self.batch_size]).cpu()
                          for i in range(0, len(u8_BFHWC), self.batch_size)])

    def encode_text(self, captions: Sequence[str]) -> TextOutput:
        return self.text.encode(captions)

    @property
    def empty_text(self) -> torch.Tensor:
        """The empty prompt's embedding [L, C] (caption dropout, guidance): what empty_text.pt holds."""
        if self._empty is None:
            out = self.encode_text([""])
            self._empty = (out.per_sample()[0], None if out.pooled is None else out.pooled[0])
        return self._empty[0]

    @property
    def empty_pooled(self) -> Optional[torch.Tensor]:
        self.empty_text
        return self._empty[1]


def build_encoders(cfg: EncoderConfig, latent_channels: int, text_dim: int,
                   device: Optional[torch.device] = None) -> Encoders:
    device = device or resolve_device(cfg.device)
    return Encoders(build_vae(cfg, latent_channels, device), TEXT_ENCODERS[cfg.text](cfg, text_dim, device),
                    cfg.batch_size)
