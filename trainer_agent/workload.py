"""The reference multimodal workload: synthetic captioned images and clips, and a tiny VLM.

Every sample is a pure function of ``(seed, index)``: a coloured shape on a coloured background,
at one of several resolutions (so visual token counts vary), sometimes a short clip in which the
shape moves, with a caption that describes it. The model is a small ViT-style encoder, a
projector and a small causal language model over ``[visual tokens; text tokens]`` trained with
next-token loss on the caption. See docs/trainer.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.1, 0.2, 0.9),
    "yellow": (0.9, 0.9, 0.1),
    "purple": (0.6, 0.1, 0.8),
    "orange": (1.0, 0.55, 0.0),
    "white": (0.95, 0.95, 0.95),
    "black": (0.05, 0.05, 0.05),
}
SHAPES = ("square", "circle", "triangle", "cross")
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "middle", "right")
MOTIONS = ("left", "right", "up", "down")
SIZES = ("small", "large")
IMAGE_SIZES_PX = (16, 24, 32, 40, 48)
CLIP_SIZES_PX = (16, 24)
CLIP_FRAMES = (2, 3, 4)
VIDEO_FRACTION = 0.3

SPECIAL_WORDS = ("<pad>", "<bos>", "<eos>")
FUNCTION_WORDS = ("a", "an", "image", "clip", "of", "on", "at", "the", "background", "moving", "and")
PLACE_WORDS = ("top", "middle", "bottom", "left", "right", "up", "down")
VOCAB: tuple[str, ...] = SPECIAL_WORDS + FUNCTION_WORDS + tuple(COLOURS) + SHAPES + PLACE_WORDS + SIZES
WORD_ID: dict[str, int] = {word: i for i, word in enumerate(VOCAB)}
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass(frozen=True)
class SampleSpec:
    """What a synthetic sample shows, decided from (seed, index) without rendering any pixels."""

    index: int
    modality: str  # "image" or "video"
    size_px: int
    frames: int
    shape: str
    colour: str
    background: str
    row: int
    column: int
    large: bool
    motion: str | None
    caption: tuple[str, ...]
    patch_px: int = 8

    @property
    def visual_tokens(self) -> int:
        """Patches the vision encoder sees: frames x (size / patch)^2."""
        side = self.size_px // self.patch_px
        return self.frames * side * side

    @property
    def text_tokens(self) -> int:
        """Predicted caption tokens (the words plus <eos>), the tokens the loss is averaged over."""
        return len(self.caption) + 1


def _sample_rng(seed: int, index: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, index, stream]))


def sample_spec(seed: int, index: int, patch_px: int = 8) -> SampleSpec:
    """Decide the content and caption of sample ``index`` of the stream seeded by ``seed``."""
    rng = _sample_rng(seed, index, 0)
    is_video = bool(rng.random() < VIDEO_FRACTION)
    size_px = int(rng.choice(CLIP_SIZES_PX if is_video else IMAGE_SIZES_PX))
    frames = int(rng.choice(CLIP_FRAMES)) if is_video else 1
    colour_names = list(COLOURS)
    colour_i, background_i = rng.choice(len(colour_names), size=2, replace=False)
    colour, background = colour_names[int(colour_i)], colour_names[int(background_i)]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    row, column = int(rng.integers(3)), int(rng.integers(3))
    large = bool(rng.random() < 0.5)
    motion = MOTIONS[int(rng.integers(len(MOTIONS)))] if is_video else None
    detail = int(rng.integers(3))  # caption verbosity: short, medium, long

    words: list[str] = []
    if detail == 2:
        words += ["an", "image", "of"] if not is_video else ["a", "clip", "of"]
    words.append("a")
    if detail >= 1:
        words.append("large" if large else "small")
    words += [colour, shape]
    if motion:
        words += ["moving", motion]
    if detail >= 1:
        words += ["on", background]
    if detail == 2:
        words += ["background", "at", "the", ROWS[row], COLUMNS[column]]
    caption = tuple(words)
    return SampleSpec(
        index=index, modality="video" if is_video else "image", size_px=size_px, frames=frames,
        shape=shape, colour=colour, background=background, row=row, column=column, large=large,
        motion=motion, caption=caption, patch_px=patch_px,
    )


def _shape_mask(shape: str, size_px: int, centre_y: float, centre_x: float, radius: float) -> np.ndarray:
    ys, xs = np.mgrid[0:size_px, 0:size_px].astype(np.float32) + 0.5
    dy, dx = ys - centre_y, xs - centre_x
    if shape == "square":
        return (np.abs(dy) <= radius) & (np.abs(dx) <= radius)
    if shape == "circle":
        return dy * dy + dx * dx <= radius * radius
    if shape == "triangle":
        return (dy <= radius) & (dy >= -radius) & (np.abs(dx) <= (dy + radius) / 2)
    return ((np.abs(dy) <= radius / 3) & (np.abs(dx) <= radius)) | ((np.abs(dx) <= radius / 3) & (np.abs(dy) <= radius))


def render_pixels(spec: SampleSpec, seed: int) -> np.ndarray:
    """Render the sample as float32 pixels shaped (frames, size, size, 3) in [0, 1]."""
    rng = _sample_rng(seed, spec.index, 1)
    size = spec.size_px
    radius = size * (0.22 if spec.large else 0.13)
    cell = size / 3
    base_y, base_x = (spec.row + 0.5) * cell, (spec.column + 0.5) * cell
    step_px = size / 8
    move_y, move_x = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0), None: (0, 0)}[spec.motion]
    pixels = np.empty((spec.frames, size, size, 3), dtype=np.float32)
    pixels[:] = np.asarray(COLOURS[spec.background], dtype=np.float32)
    for frame in range(spec.frames):
        offset = frame - (spec.frames - 1) / 2
        mask = _shape_mask(spec.shape, size, base_y + move_y * step_px * offset, base_x + move_x * step_px * offset, radius)
        pixels[frame][mask] = np.asarray(COLOURS[spec.colour], dtype=np.float32)
    pixels += rng.normal(0.0, 0.05, size=pixels.shape).astype(np.float32)
    return np.clip(pixels, 0.0, 1.0)


@dataclass
class RenderedSample:
    """A sample ready for the model: patches plus their grid coordinates, and caption ids."""

    spec: SampleSpec
    patches: torch.Tensor  # (visual_tokens, patch*patch*3) float32
    patch_rows: torch.Tensor  # (visual_tokens,) long
    patch_cols: torch.Tensor
    patch_frames: torch.Tensor
    caption_ids: torch.Tensor  # (len(caption),) long


def render_sample(spec: SampleSpec, seed: int) -> RenderedSample:
    """Render and patchify one sample; deterministic in (seed, spec.index)."""
    pixels = render_pixels(spec, seed)
    p = spec.patch_px
    side = spec.size_px // p
    patches = pixels.reshape(spec.frames, side, p, side, p, 3).transpose(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(spec.frames * side * side, p * p * 3)
    frames, rows, cols = np.meshgrid(np.arange(spec.frames), np.arange(side), np.arange(side), indexing="ij")
    return RenderedSample(
        spec=spec,
        patches=torch.from_numpy(np.ascontiguousarray(patches)),
        patch_rows=torch.from_numpy(rows.reshape(-1)).long(),
        patch_cols=torch.from_numpy(cols.reshape(-1)).long(),
        patch_frames=torch.from_numpy(frames.reshape(-1)).long(),
        caption_ids=torch.tensor([WORD_ID[w] for w in spec.caption], dtype=torch.long),
    )


@dataclass
class MicroBatch:
    """Padded tensors for one micro-batch, plus what it holds per modality."""

    patches: torch.Tensor  # (B, Lv, patch_dim)
    patch_rows: torch.Tensor  # (B, Lv)
    patch_cols: torch.Tensor
    patch_frames: torch.Tensor
    patch_modality: torch.Tensor  # (B,) 0 image, 1 video
    visual_lengths: list[int]
    text_inputs: torch.Tensor  # (B, Lt) <bos> + caption, padded
    text_targets: torch.Tensor  # (B, Lt) caption + <eos>, padded with -100
    text_lengths: list[int]
    tokens: dict[str, int] = field(default_factory=dict)
    sample_indices: list[int] = field(default_factory=list)

    def to(self, device: torch.device) -> MicroBatch:
        """Move the tensors to ``device`` (non-blocking where pinned)."""
        moved = {
            name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for name, value in self.__dict__.items()
        }
        return MicroBatch(**moved)


def collate(samples: list[RenderedSample]) -> MicroBatch:
    """Pad a list of rendered samples into one micro-batch."""
    batch = len(samples)
    visual_lengths = [s.patches.shape[0] for s in samples]
    text_lengths = [s.caption_ids.shape[0] + 1 for s in samples]
    lv, lt = max(visual_lengths), max(text_lengths)
    patch_dim = samples[0].patches.shape[1]
    patches = torch.zeros(batch, lv, patch_dim)
    rows = torch.zeros(batch, lv, dtype=torch.long)
    cols = torch.zeros(batch, lv, dtype=torch.long)
    frames = torch.zeros(batch, lv, dtype=torch.long)
    text_inputs = torch.full((batch, lt), PAD_ID, dtype=torch.long)
    text_targets = torch.full((batch, lt), -100, dtype=torch.long)
    tokens = {"image": 0, "video": 0, "text": 0}
    for i, s in enumerate(samples):
        n = visual_lengths[i]
        patches[i, :n] = s.patches
        rows[i, :n], cols[i, :n], frames[i, :n] = s.patch_rows, s.patch_cols, s.patch_frames
        caption = s.caption_ids
        text_inputs[i, 0] = BOS_ID
        text_inputs[i, 1 : 1 + caption.shape[0]] = caption
        text_targets[i, : caption.shape[0]] = caption
        text_targets[i, caption.shape[0]] = EOS_ID
        tokens[s.spec.modality] += n
        tokens["text"] += text_lengths[i]
    modality = torch.tensor([1 if s.spec.modality == "video" else 0 for s in samples], dtype=torch.long)
    return MicroBatch(
        patches=patches, patch_rows=rows, patch_cols=cols, patch_frames=frames, patch_modality=modality,
        visual_lengths=visual_lengths, text_inputs=text_inputs, text_targets=text_targets,
        text_lengths=text_lengths, tokens=tokens, sample_indices=[s.spec.index for s in samples],
    )


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the reference model; the defaults train a step at DP=2 in well under a second on CPU."""

    patch_px: int = 8
    max_grid: int = 6
    max_frames: int = 4
    vision_width: int = 64
    vision_layers: int = 2
    lm_width: int = 64
    lm_layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    max_text: int = 24
    vocab_size: int = len(VOCAB)

    def as_dict(self) -> dict[str, int]:
        """Plain dict, stored in checkpoints."""
        return asdict(self)


MODEL_PRESETS: dict[str, ModelConfig] = {
    # The reference: a step at DP=2 takes a few tens of milliseconds on 2 CPU cores.
    "tiny": ModelConfig(),
    # Finer patches (4x the visual tokens) and wider layers: compute, not per-op overhead,
    # dominates, so modality balancing and checkpoint sizes show up in measurements.
    "small": ModelConfig(patch_px=4, max_grid=12, vision_width=128, lm_width=128, heads=4),
}


class Block(nn.Module):
    """Pre-norm transformer block with explicit attention maths (deterministic on every device)."""

    def __init__(self, width: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width))

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        """``attn_bias`` is added to the attention scores: 0 where allowed, a large negative where not."""
        b, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(width // self.heads)) + attn_bias
        mixed = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, length, width)
        x = x + self.proj(mixed)
        return x + self.mlp(self.norm2(x))


class MultimodalLM(nn.Module):
    """Vision encoder (patch embedding + blocks), projector, and causal LM over [visual; text]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = nn.Linear(c.patch_px * c.patch_px * 3, c.vision_width)
        self.row_embed = nn.Embedding(c.max_grid, c.vision_width)
        self.col_embed = nn.Embedding(c.max_grid, c.vision_width)
        self.frame_embed = nn.Embedding(c.max_frames, c.vision_width)
        self.modality_embed = nn.Embedding(2, c.vision_width)
        self.vision_blocks = nn.ModuleList(Block(c.vision_width, c.heads, c.mlp_ratio) for _ in range(c.vision_layers))
        self.vision_norm = nn.LayerNorm(c.vision_width)
        self.projector = nn.Sequential(nn.Linear(c.vision_width, c.lm_width), nn.GELU(), nn.Linear(c.lm_width, c.lm_width))
        self.token_embed = nn.Embedding(c.vocab_size, c.lm_width)
        self.position_embed = nn.Embedding(c.max_grid * c.max_grid * c.max_frames + c.max_text + 1, c.lm_width)
        self.lm_blocks = nn.ModuleList(Block(c.lm_width, c.heads, c.mlp_ratio) for _ in range(c.lm_layers))
        self.lm_norm = nn.LayerNorm(c.lm_width)
        self.lm_head = nn.Linear(c.lm_width, c.vocab_size, bias=False)

    def forward(self, batch: MicroBatch) -> torch.Tensor:
        """Return the sum over the micro-batch of the caption tokens' cross-entropy (nats)."""
        device = batch.patches.device
        b, lv, _ = batch.patches.shape
        x = (
            self.patch_embed(batch.patches)
            + self.row_embed(batch.patch_rows)
            + self.col_embed(batch.patch_cols)
            + self.frame_embed(batch.patch_frames)
            + self.modality_embed(batch.patch_modality)[:, None, :]
        )
        vis_len = torch.tensor(batch.visual_lengths, device=device)
        key_valid = torch.arange(lv, device=device)[None, :] < vis_len[:, None]
        vision_bias = torch.zeros(b, 1, 1, lv, device=device, dtype=x.dtype).masked_fill(~key_valid[:, None, None, :], -1e9)
        for block in self.vision_blocks:
            x = block(x, vision_bias)
        visual = self.projector(self.vision_norm(x))

        # Each sample's sequence is [its visual tokens; <bos> caption], padding after both.
        text = self.token_embed(batch.text_inputs)
        lt = text.shape[1]
        rows = []
        for i in range(b):
            n = batch.visual_lengths[i]
            rows.append(torch.cat([visual[i, :n], text[i], visual.new_zeros(lv - n, visual.shape[-1])]))
        seq = torch.stack(rows)
        length = lv + lt
        seq = seq + self.position_embed(torch.arange(length, device=device))[None]
        causal = torch.ones(length, length, device=device, dtype=torch.bool).tril()
        lm_bias = torch.zeros(1, 1, length, length, device=device, dtype=seq.dtype).masked_fill(~causal, -1e9)
        for block in self.lm_blocks:
            seq = block(seq, lm_bias)
        seq = self.lm_norm(seq)
        text_states = torch.stack([seq[i, batch.visual_lengths[i] : batch.visual_lengths[i] + lt] for i in range(b)])
        logits = self.lm_head(text_states).float()
        return summed_token_nll(logits, batch.text_targets)


def summed_token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(target) over positions whose target is not -100.

    Written with a one-hot mask instead of ``F.cross_entropy``: CUDA's NLL loss has no
    deterministic implementation, and this trainer runs with ``use_deterministic_algorithms``.
    """
    log_probs = logits.log_softmax(dim=-1)
    valid = targets != -100
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    one_hot = targets.clamp(min=0).unsqueeze(-1) == vocab
    token_nll = -(log_probs * one_hot).sum(dim=-1)
    return (token_nll * valid).sum()


def estimated_cost(spec: SampleSpec, config: ModelConfig) -> float:
    """Rough FLOPs of one sample's forward: vision attention ~ tokens^2, the rest ~ linear."""
    return estimated_cost_of_tokens(spec.visual_tokens, spec.text_tokens, config)


def estimated_cost_of_tokens(v: int, t: int, config: ModelConfig) -> float:
    """Rough forward FLOPs for ``v`` visual and ``t`` text tokens (see ``estimated_cost``)."""
    vw, lw = config.vision_width, config.lm_width
    vision = config.vision_layers * (12 * v * vw * vw + 2 * v * v * vw)
    lm_len = v + t
    lm = config.lm_layers * (12 * lm_len * lw * lw + 2 * lm_len * lm_len * lw)
    return float(vision + lm + lm_len * lw * config.vocab_size)


def micro_batch_cost(specs: list[SampleSpec], config: ModelConfig) -> float:
    """Estimated cost of a padded micro-batch: every sample pays for the longest one."""
    if not specs:
        return 0.0
    v = max(s.visual_tokens for s in specs)
    t = max(s.text_tokens for s in specs)
    return len(specs) * estimated_cost_of_tokens(v, t, config)
