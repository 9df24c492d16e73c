"""MammothModa2 tokenizer (tiktoken) and the text-to-image prompt envelope.

Files (upstream ``MammothUTokenizer``, ``bytedance/mammothmoda`` @ 2317bbce,
``mammothmoda2/model/mammothmoda2_qwen2_5_vl/tokenization_mammothmoda2_qwen2_5_vl.py``):

* ``mammothu.tiktoken``: one ``base64(token_bytes) rank`` per line (tiktoken BPE rank file).
* ``mammothu_vision_tokens.txt``: one special-token surface form per line, appended after the
  generation specials (``<|image start|>``, ``<|image end|>``, ``<|image token|>``,
  ``<|visual token 000000|>``, ...).

Special-token layout (ids are consecutive after the BPE ranks):

1. ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, then the 19 Qwen specials
   (``<|object_ref_start|>`` ... ``<|file_sep|>``);
2. ``<|extra_i|>`` (upstream: 181 of them, to Qwen2.5's tokenizer length 151846), then
   ``<|extra_margin_i|>`` up to the base vocabulary size (the embedding size 152064, which is
   ``gen_vocab_start_index``);
3. ``<|endofline|>``, ``<|endoffile|>``, ``<|gen_placeholder|>``, ``<|useless token|>``,
   ``<|beginoftext|>`` (BOS) — the first generation ids;
4. the vision-tokens file, in file order.

Upstream fixes the first special id at 151643 (= the number of Qwen BPE ranks); here it is
``len(mergeable_ranks)``, which is the same for the real files and lets a small tokenizer
(`write_tokenizer_files`) use the same layout.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

import tiktoken

__all__ = [
    "DEFAULT_NEGATIVE_PROMPT",
    "SYSTEM_PROMPT",
    "TOKENIZER_FILE",
    "VISION_TOKENS_FILE",
    "MammothTokenizer",
    "write_tokenizer_files",
]

TOKENIZER_FILE = "mammothu.tiktoken"
VISION_TOKENS_FILE = "mammothu_vision_tokens.txt"

# Qwen2 pre-tokenisation regex (upstream PAT_STR).
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
ENDOFTEXT = "<|endoftext|>"
IMSTART = "<|im_start|>"
IMEND = "<|im_end|>"
QWEN_SPECIAL_TOKENS = (
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
NUM_EXTRAS = 181  # upstream: 205 - 19 Qwen specials - 5, aligning to Qwen2.5's 151846 tokens
GEN_SPECIAL_TOKENS = ("<|endofline|>", "<|endoffile|>", "<|gen_placeholder|>", "<|useless token|>", "<|beginoftext|>")
BOI_TOKEN = "<|image start|>"
EOI_TOKEN = "<|image end|>"
IMG_TOKEN = "<|image token|>"
VISUAL_TOKEN_TEMPLATE = "<|visual token {:06d}|>"
VISUAL_TOKEN_RE = re.compile(r"^<\|visual token (\d+)\|>$")
# Upstream Qwen2.5 sizes: 151643 BPE ranks, base vocabulary (embedding rows) 152064.
UPSTREAM_NUM_RANKS = 151643
UPSTREAM_BASE_VOCAB = 152064

SYSTEM_PROMPT = "You are a helpful image generator."
# Upstream processing_mammothmoda2.DEFAULT_NEGATIVE_PROMPT.
DEFAULT_NEGATIVE_PROMPT = (
    "deformed, blurry, over saturation, bad anatomy, disfigured, poorly drawn face, mutation, mutated, "
    "extra_limb, ugly, poorly drawn hands, fused fingers, messy drawing, broken legs censor, censored, "
    "censor_bar Create an image from the instruction."
)


def _special_tokens_layout(num_ranks: int, base_vocab_size: int, vision_tokens: list[str]) -> dict[str, int]:
    """Assign ids to every special token (see the module docstring for the layout)."""
    head = (ENDOFTEXT, IMSTART, IMEND) + QWEN_SPECIAL_TOKENS
    room = base_vocab_size - num_ranks - len(head)
    if room < 0:
        raise ValueError(
            f"base vocabulary {base_vocab_size} too small for {num_ranks} ranks + {len(head)} Qwen specials"
        )
    num_extras = min(NUM_EXTRAS, room)
    names = (
        list(head)
        + [f"<|extra_{i}|>" for i in range(num_extras)]
        + [f"<|extra_margin_{i}|>" for i in range(room - num_extras)]
        + list(GEN_SPECIAL_TOKENS)
        + list(vision_tokens)
    )
    if len(set(names)) != len(names):
        raise ValueError("duplicate special token in the vision tokens file")
    return {name: num_ranks + i for i, name in enumerate(names)}


def _read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{line_no}: expected 'base64 rank', got {line[:60]!r}")
        ranks[base64.b64decode(parts[0])] = int(parts[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not the contiguous range 0..{len(ranks) - 1}")
    return ranks


class MammothTokenizer:
    """Byte-level BPE tokenizer (tiktoken) with MammothModa2's special tokens.

    Attributes (token ids, ``int``):
        endoftext_id (EOS and PAD), im_start_id, im_end_id, bos_id (``<|beginoftext|>``),
        eol_id (``<|endofline|>``), eof_id, gen_placeholder_id, boi_id (``<|image start|>``),
        eoi_id (``<|image end|>``), img_token_id (``<|image token|>``), image_pad_id, video_pad_id,
        vision_start_id, vision_end_id.
        visual_tokens_ids: ``[image_pad, video_pad, vision_start, vision_end]`` (upstream order; rows
            with these ids are excluded from the DiT text condition).
        visual_token_start_id: id of ``<|visual token 000000|>``.
        visual_token_end_id: one past the last visual-code id (**exclusive**, as vllm-omni uses it:
            codes are ``[visual_token_start_id, visual_token_end_id)``).
        base_vocab_size: ``gen_vocab_start_index`` (first generation id).
        n_vocab: total number of ids.
    """

    def __init__(self, mergeable_ranks: dict[bytes, int], vision_tokens: list[str], base_vocab_size: int) -> None:
        self.mergeable_ranks = mergeable_ranks
        self.base_vocab_size = base_vocab_size
        self.special_tokens = _special_tokens_layout(len(mergeable_ranks), base_vocab_size, vision_tokens)
        self._encoding = tiktoken.Encoding(
            "mammothu", pat_str=PAT_STR, mergeable_ranks=mergeable_ranks, special_tokens=self.special_tokens
        )
        self.n_vocab = self._encoding.n_vocab
        if self.n_vocab != len(mergeable_ranks) + len(self.special_tokens):
            raise ValueError("token ids are not contiguous")
        self.id_to_special = {i: t for t, i in self.special_tokens.items()}
        for required in (BOI_TOKEN, EOI_TOKEN, IMG_TOKEN):
            if required not in self.special_tokens:
                raise ValueError(f"vision tokens file lacks {required}")
        sp = self.special_tokens
        self.endoftext_id = sp[ENDOFTEXT]
        self.eos_id = self.pad_id = self.endoftext_id
        self.im_start_id = sp[IMSTART]
        self.im_end_id = sp[IMEND]
        self.eol_id = sp["<|endofline|>"]
        self.eof_id = sp["<|endoffile|>"]
        self.gen_placeholder_id = sp["<|gen_placeholder|>"]
        self.bos_id = sp["<|beginoftext|>"]
        self.boi_id = sp[BOI_TOKEN]
        self.eoi_id = sp[EOI_TOKEN]
        self.img_token_id = sp[IMG_TOKEN]
        self.image_pad_id = sp["<|image_pad|>"]
        self.video_pad_id = sp["<|video_pad|>"]
        self.vision_start_id = sp["<|vision_start|>"]
        self.vision_end_id = sp["<|vision_end|>"]
        self.visual_tokens_ids = [self.image_pad_id, self.video_pad_id, self.vision_start_id, self.vision_end_id]
        codes = sorted(
            (int(m.group(1)), idx) for tok, idx in sp.items() if (m := VISUAL_TOKEN_RE.match(tok)) is not None
        )
        if not codes:
            raise ValueError("vision tokens file has no <|visual token NNNNNN|> entries")
        self.visual_token_start_id = codes[0][1]
        self.num_visual_tokens = len(codes)
        self.visual_token_end_id = self.visual_token_start_id + self.num_visual_tokens
        expected = list(range(self.visual_token_start_id, self.visual_token_end_id))
        if [idx for _, idx in codes] != expected or codes[0][0]:
            raise ValueError("visual tokens must be consecutive <|visual token 000000|>, 000001, ...")

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, base_vocab_size: int | None = None) -> MammothTokenizer:
        """Load ``mammothu.tiktoken`` and ``mammothu_vision_tokens.txt`` from ``directory``.

        Args:
            base_vocab_size: first generation id (``gen_vocab_start_index``). When ``None`` it is read
                from ``config.json`` (``llm_config.gen_vocab_start_index`` or ``vocab_size``) in the
                same directory, else it is upstream's 152064 when the rank file has upstream's 151643
                ranks.

        Raises:
            FileNotFoundError: a tokenizer file is missing.
            ValueError: malformed files, or no way to know the base vocabulary size.
        """
        directory = Path(directory)
        ranks = _read_ranks(directory / TOKENIZER_FILE)
        vision_tokens = [
            line.strip() for line in (directory / VISION_TOKENS_FILE).read_text(encoding="utf-8").splitlines()
        ]
        vision_tokens = [t for t in vision_tokens if t]
        if base_vocab_size is None:
            base_vocab_size = _base_vocab_from_config(directory / "config.json")
        if base_vocab_size is None:
            if len(ranks) != UPSTREAM_NUM_RANKS:
                raise ValueError(
                    f"{directory}: cannot infer the base vocabulary size ({len(ranks)} ranks, no config.json); "
                    "pass base_vocab_size"
                )
            base_vocab_size = UPSTREAM_BASE_VOCAB
        return cls(ranks, vision_tokens, base_vocab_size)

    # ---- encoding -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Encode plain text (NFC-normalised, as upstream). Special-token surface forms in ``text``
        are encoded as ordinary text, never as special ids."""
        return self._encoding.encode_ordinary(unicodedata.normalize("NFC", text))

    def encode_t2i_prompt(self, prompt: str, ar_width: int, ar_height: int) -> list[int]:
        """Token ids of the text-to-image envelope (MODEL.md; vllm-omni ``_format_prompt``)::

            <|im_start|>system\\nYou are a helpful image generator.<|im_end|>\\n<|im_start|>user\\n{prompt}
            <|im_end|>\\n<|im_start|>assistant\\n<|image start|>{ar_width}*{ar_height}<|image token|>

        (without the line break after ``{prompt}``). ``ar_width``/``ar_height`` are grid sizes
        (image size // 16).

        Raises:
            ValueError: ``ar_width`` or ``ar_height`` < 1.
        """
        if ar_width < 1 or ar_height < 1:
            raise ValueError(f"ar_width and ar_height must be >= 1, got {ar_width}x{ar_height}")
        return (
            self._chat_turn("system", SYSTEM_PROMPT)
            + self._chat_turn("user", prompt)
            + [self.im_start_id]
            + self.encode("assistant\n")
            + [self.boi_id]
            + self.encode(f"{ar_width}*{ar_height}")
            + [self.img_token_id]
        )

    def encode_negative_prompt(self, text: str = DEFAULT_NEGATIVE_PROMPT) -> list[int]:
        """Token ids of a negative prompt, as upstream's processor builds it: the chat template over
        ``[system: SYSTEM_PROMPT, user: text]`` without a generation prompt::

            <|im_start|>system\\nYou are a helpful image generator.<|im_end|>\\n<|im_start|>user\\n{text}<|im_end|>\\n
        """
        return self._chat_turn("system", SYSTEM_PROMPT) + self._chat_turn("user", text)

    def _chat_turn(self, role: str, content: str) -> list[int]:
        # One ordinary segment "role\ncontent" between specials: identical to tokenising the whole
        # templated string with specials allowed, because tiktoken splits at specials first.
        return [self.im_start_id] + self.encode(f"{role}\n{content}") + [self.im_end_id] + self.encode("\n")

    # ---- decoding -------------------------------------------------------------------------------

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``; special tokens appear as their surface forms unless skipped
        (upstream skips every id ``>=`` ``<|endoftext|>``'s id). Invalid UTF-8 is replaced.

        Raises:
            ValueError: an id outside ``[0, n_vocab)``.
        """
        ids = [int(i) for i in token_ids]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.n_vocab}): {bad[:5]}")
        if skip_special_tokens:
            ids = [i for i in ids if i < self.endoftext_id]
        return self._encoding.decode(ids, errors="replace")

    def is_generation_id(self, token_id: int) -> bool:
        """True for ids ``>= base_vocab_size`` (generation embedding, experts and head)."""
        return token_id >= self.base_vocab_size

    def id_map(self) -> dict[str, int]:
        """The ids a model config / ``t2i_generation_config.json`` needs (see `write_tokenizer_files`)."""
        return {
            "vocab_size": self.base_vocab_size,
            "gen_vocab_start_index": self.base_vocab_size,
            "image_token_id": self.image_pad_id,
            "video_token_id": self.video_pad_id,
            "vision_start_token_id": self.vision_start_id,
            "vision_end_token_id": self.vision_end_id,
            "eol_token_id": self.eol_id,
            "visual_token_start_id": self.visual_token_start_id,
            "visual_token_end_id": self.visual_token_end_id,
            "boi_token_id": self.boi_id,
            "eoi_token_id": self.eoi_id,
            "img_token_id": self.img_token_id,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
        }


def _base_vocab_from_config(path: Path) -> int | None:
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    llm = config.get("llm_config", config)
    text = llm.get("text_config") if isinstance(llm.get("text_config"), dict) else {}
    for source in (text, llm):
        if source.get("gen_vocab_start_index") is not None:
            return int(source["gen_vocab_start_index"])
    for source in (text, llm):
        if source.get("vocab_size") is not None and source.get("extra_gen_vocab", True):
            return int(source["vocab_size"])
    return None


# ---- a small tokenizer for the built-in tiny checkpoint -----------------------------------------

_TRAINING_TEXT = (
    "You are a helpful image generator. system user assistant "
    "A photo of a cat sitting on the table in the garden. The quick brown fox jumps over the lazy dog. "
    "A painting of the mountains at sunset, with a river and trees in the evening light. "
    "deformed, blurry, over saturation, bad anatomy, disfigured, poorly drawn face, mutation, ugly. "
    "Create an image from the instruction. 0123456789 * \n"
)


def _train_bpe_merges(text: str, num_merges: int) -> list[bytes]:
    """Greedy byte-pair merges over ``text`` (deterministic: ties broken by the byte strings)."""
    words: Counter[tuple[bytes, ...]] = Counter()
    for match in re.finditer(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", text):
        words[tuple(bytes([b]) for b in match.group(0).encode("utf-8"))] += 1
    merges: list[bytes] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for a, b in itertools.pairwise(word):
                pairs[(a, b)] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merged = a + b
        merges.append(merged)
        new_words: Counter[tuple[bytes, ...]] = Counter()
        for word, count in words.items():
            out: list[bytes] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return merges


def write_tokenizer_files(
    directory: str | Path,
    *,
    num_visual_tokens: int,
    base_vocab_size: int = 512,
    num_merges: int = 40,
) -> dict[str, Any]:
    """Write a small tokenizer in the real file formats (for the built-in tiny checkpoint).

    Ranks: the 256 single bytes (rank = byte value) then ``num_merges`` BPE merges learnt from a
    fixed English text; the specials follow in upstream's layout, padded to ``base_vocab_size``;
    the vision-tokens file holds ``<|image start|>``, ``<|image end|>``, ``<|image token|>`` and
    ``num_visual_tokens`` codes ``<|visual token 000000|>``....

    With the defaults the generation ids equal the reference fixture's: ``<|endofline|>`` = 512,
    ``<|image start|>`` = 517, ``<|image end|>`` = 518.

    Returns:
        ``vocab_size`` (base, = ``gen_vocab_start_index``), ``gen_vocab_start_index``,
        ``gen_vocab_size`` (generation ids rounded up to a multiple of 32), ``image_token_id``,
        ``video_token_id``, ``vision_start_token_id``, ``vision_end_token_id``, ``eol_token_id``,
        ``visual_token_start_id``, ``visual_token_end_id`` (exclusive), ``boi_token_id``,
        ``eoi_token_id``, ``img_token_id``, ``bos_token_id``, ``eos_token_id``, ``pad_token_id``,
        ``num_visual_tokens``.

    Raises:
        ValueError: ``num_visual_tokens < 1`` or a base vocabulary too small for the specials.
    """
    if num_visual_tokens < 1:
        raise ValueError(f"num_visual_tokens must be >= 1, got {num_visual_tokens}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = {bytes([b]): b for b in range(256)}
    for merged in _train_bpe_merges(_TRAINING_TEXT, num_merges):
        ranks.setdefault(merged, len(ranks))
    codes = [VISUAL_TOKEN_TEMPLATE.format(i) for i in range(num_visual_tokens)]
    vision_tokens = [BOI_TOKEN, EOI_TOKEN, IMG_TOKEN, *codes]
    # Validate the layout before writing anything.
    tokenizer = MammothTokenizer(ranks, vision_tokens, base_vocab_size)
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}" for tok, rank in ordered]
    (directory / TOKENIZER_FILE).write_text("\n".join(lines) + "\n", encoding="ascii")
    (directory / VISION_TOKENS_FILE).write_text("\n".join(vision_tokens) + "\n", encoding="utf-8")
    ids = tokenizer.id_map()
    ids["gen_vocab_size"] = int(math.ceil((tokenizer.n_vocab - base_vocab_size) / 32) * 32)
    ids["num_visual_tokens"] = num_visual_tokens
    return ids
