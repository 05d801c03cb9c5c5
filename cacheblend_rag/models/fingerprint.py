"""Fingerprints that tie a stored KV to the exact model weights, dtype and tokenizer."""

from __future__ import annotations

import hashlib
import json

import torch


def model_fingerprint(model) -> str:
    """Hash of the config, the compute dtype and a strided sample of every weight (fast, content-based)."""
    return _weights_hash(model, per_dtype=True).hexdigest()[:16]


def _weights_hash(model, per_dtype: bool):
    """sha256 over the config and ~1k evenly spaced elements per tensor (they tell fine-tunes and random inits apart);
    `per_dtype`: bound to the compute dtype, else the samples rounded to bf16, so a float32 model and its bfloat16
    cast hash alike."""
    h = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in model.named_parameters():
        sample = param.detach().reshape(-1)[:: max(1, param.numel() // 1024)].to("cpu")
        sample = sample.to(torch.float32) if per_dtype else sample.to(torch.bfloat16).to(torch.float32)
        h.update(f"{name}:{tuple(param.shape)}{f':{param.dtype}' if per_dtype else ''}".encode())
        h.update(sample.numpy().tobytes())
    return h


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary and special tokens."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    return h.hexdigest()[:16]


def weights_fingerprint(model, tokenizer) -> str:
    """Like `model_fingerprint` + `tokenizer_fingerprint`, but the same whatever dtype the model runs in: what
    trained links are keyed by (trained in float32, they serve the bfloat16 run of the same weights too)."""
    h = _weights_hash(model, per_dtype=False)
    h.update(tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()[:16]
