"""Key/value caches: the full preallocated cache, and the budgeted partial cache that drafting reads.

The full cache holds every committed token in slot order (slot i = position i). A forward appends its new tokens
after the committed ones; the caller then commits them all (prefill, vanilla step), keeps a subset (the accepted
path of a verified tree, compacted in place) or drops them (rollback).

The partial cache (TokenSwift's dynamic KV management) gives the one-token draft pass a fixed-size view: 16 sink
tokens, the tokens the latest query attends to most (scored per KV head), and the most recent tokens, which
overwrite the lowest-scored slots as they arrive. Once they would reach the sinks, the whole sequence is re-scored.

Where our CPU kernels run attention (float32 or bfloat16 on a CPU) both caches store keys in tiles of 64 slots,
[layers, kv_heads, slots / 64, d, 64]: a tile holds element j of its 64 keys together, so the kernel's scores
vectorise along the keys, and is one contiguous block the memory streams at its full rate (kernels/attention.h:
key_offset). `keys()` gives them as [layers, kv_heads, slots, d], the layout they have elsewhere. A native
model's cache is bfloat16 (Transformer.cache_dtype): keys and values rounded once as they are written, half the
bytes every step reads.
"""
from __future__ import annotations

import torch
from torch import Tensor

from core.runtime import large_pages
from core.runtime.kernels import cpu


NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # cache formats the CPU kernel reads
KEY_TILE = 64  # slots per tile of keys stored in tiles (kernels/attention.h: kTile)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A zeroed cache buffer: on a CPU on huge pages (large_pages), which every step's attention reads."""
    if torch.device(device).type == "cpu":
        return large_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def tiled(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a cache of `dtype` on `device` stores its keys in tiles: where our CPU kernels read it."""
    return torch.device(device).type == "cpu" and dtype in NATIVE_DTYPES and cpu.kernel() is not None


def key_buffer(n_layers: int, n_kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype,
               device: torch.device | str) -> Tensor:
    """Zeroed keys: in tiles, [n_layers, n_kv_heads, ceil(slots / 64), head_dim, 64], where `tiled`, else
    [n_layers, n_kv_heads, slots, head_dim]."""
    if tiled(dtype, device):
        return zeroed((n_layers, n_kv_heads, -(-slots // KEY_TILE), head_dim, KEY_TILE), dtype, device)
    return zeroed((n_layers, n_kv_heads, slots, head_dim), dtype, device)


def tile_keys(keys: Tensor) -> Tensor:
    """Keys [..., slots, d] in tiles [..., ceil(slots / 64), d, 64] (zeros past the last slot), as the CPU kernels
    read them."""
    *lead, slots, d = keys.shape
    tiles = -(-slots // KEY_TILE)
    padded = keys.new_zeros(*lead, tiles * KEY_TILE, d)
    padded[..., :slots, :] = keys
    return padded.view(*lead, tiles, KEY_TILE, d).transpose(-1, -2).contiguous()


def untile_keys(tiles: Tensor) -> Tensor:
    """Keys in tiles [..., T, d, 64] as [..., T * 64, d] (a copy)."""
    *lead, t, d, width = tiles.shape
    return tiles.transpose(-1, -2).reshape(*lead, t * width, d)


def logical_keys(keys: Tensor, slots: int) -> Tensor:
    """Every layer's keys (a key_buffer of `slots`) as [layers, kv_heads, slots, d]: a copy where they are in tiles."""
    return untile_keys(keys)[:, :, :slots] if keys.dim() == 5 else keys


def key_slots(keys: Tensor, start: int, end: int) -> Tensor:
    """Slots [start, end) of one layer's keys (key_buffer(..)[layer]) as [kv_heads, end - start, d]: a view, or a
    copy of the tiles that hold them."""
    if keys.dim() == 3:
        return keys[:, start:end]
    t0 = start // KEY_TILE
    return untile_keys(keys[:, t0:-(-end // KEY_TILE)])[:, start - t0 * KEY_TILE:end - t0 * KEY_TILE]


def attended_keys(keys: Tensor, end: int) -> Tensor:
    """The keys of one layer that attention over slots [0, end) reads: all its tiles (the kernel takes them whole),
    or its slots up to `end`."""
    return keys if keys.dim() == 4 else keys[:, :end]


def put_key_slots(keys: Tensor, start: int, new: Tensor) -> None:
    """Write new [kv_heads, n, d] into slots start .. start + n - 1 of one layer's keys, a tile at a time."""
    if keys.dim() == 3:
        keys[:, start:start + new.shape[1]] = new
        return
    done = 0
    while done < new.shape[1]:
        slot = start + done
        at = slot % KEY_TILE
        n = min(KEY_TILE - at, new.shape[1] - done)
        keys[:, slot // KEY_TILE, :, at:at + n] = new[:, done:done + n].transpose(1, 2)
        done += n


class KVCacheTooLarge(ValueError):
    """The requested tokens' keys and values do not fit in the GPU's free memory; the message says how many do."""


GIB = 1 << 30


def free_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device."""
    return torch.cuda.mem_get_info(device)


def spare_bytes(total: int) -> int:
    """Memory a cache must leave free on a GPU of `total` bytes: the forwards' activations, a prefill chunk's
    attention scores, the logits of a tree over a 150K vocabulary and the partial cache live there too."""
    return max(2 * GIB, total // 20)


def cache_tokens_that_fit(bytes_per_token: int, device: torch.device | str) -> int | None:
    """How many tokens' keys and values fit in `device`'s free memory now (None on a CPU: not checked there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = free_memory(device)
    return max(0, (free - spare_bytes(total)) // bytes_per_token)


def check_fits(max_len: int, bytes_per_token: int, device: torch.device | str) -> None:
    """Refuse, before allocating, a CUDA cache larger than the free memory allows (a CPU allocates as before)."""
    fit = cache_tokens_that_fit(bytes_per_token, device)
    if fit is not None and max_len > fit:
        need = max_len * bytes_per_token / GIB
        raise KVCacheTooLarge(
            f"the KV cache for {max_len} tokens needs {need:.1f} GiB but {device} has room for {fit} tokens "
            f"({fit * bytes_per_token / GIB:.1f} GiB free beyond what the forwards need): ask for fewer tokens "
            f"(prompt + max new tokens) or free GPU memory")


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str):
        # keys and values of every layer: sized against the GPU's free memory first, with a clear refusal
        check_fits(max_len, 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize, device)
        self.k = key_buffer(n_layers, n_kv_heads, max_len, head_dim, dtype, device)  # (in tiles: our kernels')
        self.v = zeroed((n_layers, n_kv_heads, max_len, head_dim), dtype, device)
        # whether the keys are in tiles and our kernels move kept rows (keep): looked up once, not per forward
        self.tiled = self.k.dim() == 5
        self.max_len = max_len
        self.length = 0  # committed tokens
        self.n_new = 0  # tokens written by the last forward, not yet committed

    def begin(self, n: int) -> None:
        """Called once per forward, before the layers write `n` new tokens."""
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache full: {self.length} cached + {n} new > capacity {self.max_len}")
        self.n_new = n

    def write(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new tokens' keys/values ([kv_heads, n, d]) and return everything they may attend to: the
        layer's keys (all its tiles, where tiled; else slots up to the new tokens') and values."""
        end = self.length + k.shape[1]
        put_key_slots(self.k[layer], self.length, k)
        self.v[layer, :, self.length:end] = v
        return attended_keys(self.k[layer], end), self.v[layer, :, :end]

    def keys(self) -> Tensor:
        """Every layer's keys as [layers, kv_heads, slots, d] (a copy where they are stored in tiles)."""
        return logical_keys(self.k, self.max_len)

    def attention_mask(self, n: int, block_mask: Tensor | None, positions: Tensor,
                       sliding_window: int | None = None) -> Tensor | None:
        """Boolean [n, past + n] mask: all past slots visible, the new block masked by `block_mask` (or causal)."""
        past = self.visible_past()
        total = past + n
        if n == 1 and (sliding_window is None or total <= sliding_window):
            return None
        if block_mask is None:
            block_mask = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril_()
        mask = torch.ones(n, total, dtype=torch.bool, device=positions.device)
        mask[:, past:] = block_mask
        if sliding_window is not None and positions.max().item() >= sliding_window:
            key_pos = torch.cat([torch.arange(past, device=positions.device), positions])
            mask &= key_pos[None, :] > positions[:, None] - sliding_window
        return mask

    def visible_past(self) -> int:
        return self.length

    def commit(self) -> None:
        """Keep every token of the last forward."""
        self.length += self.n_new
        self.n_new = 0

    def keep(self, rows: Tensor | list[int]) -> None:
        """Keep only these rows of the last forward's block (increasing: a path down a tree, whose parents come
        before their children), compacted after the committed part."""
        rows = rows.tolist() if isinstance(rows, Tensor) else list(rows)
        start, m = self.length, len(rows)
        if rows == list(range(m)):  # the block's first rows (most steps): nothing moves
            if m > self.n_new:
                raise ValueError(f"rows to keep must be in the last block of {self.n_new}, got {rows}")
        elif rows != sorted(set(rows)) or not 0 <= rows[0] <= rows[-1] < self.n_new:
            raise ValueError(f"rows to keep must be distinct, increasing and in the last block, got {rows}")
        else:
            if self.tiled:  # one call for every layer (torch's indexing costs more than the copy here)
                cpu.kernel().keep_rows(self.k, self.v, start, rows)
            else:  # advanced indexing gathers into a new tensor first, so overlapping source/destination is safe
                index = torch.tensor(rows, dtype=torch.long, device=self.k.device) + start
                self.k[:, :, start:start + m] = self.k[:, :, index]
                self.v[:, :, start:start + m] = self.v[:, :, index]
        self.length += m
        self.n_new = 0

    def rollback(self, length: int | None = None) -> None:
        """Forget the last forward's tokens, or truncate to `length` committed tokens."""
        if length is not None:
            if not 0 <= length <= self.length:
                raise ValueError(f"cannot roll back to {length}: only {self.length} tokens cached")
            self.length = length
        self.n_new = 0


class PartialKVCache:
    """A budgeted view of a full cache for the draft pass; writes nothing into the full cache once active."""

    SINKS = 16

    def __init__(self, full: KVCache, budget: int):
        if budget <= self.SINKS + 1:
            raise ValueError(f"partial KV budget must exceed {self.SINKS + 1} tokens, got {budget}")
        self.full = full
        self.budget = budget
        n_layers, n_kv, _, d = full.v.shape
        # budget slots plus room for the draft pass's own new tokens
        self.slots = budget + 8
        self.k = key_buffer(n_layers, n_kv, self.slots, d, full.k.dtype, full.k.device)
        self.v = zeroed((n_layers, n_kv, self.slots, d), full.v.dtype, full.v.device)
        self.selected_at: int | None = None  # full length at the last selection
        self.synced = 0  # full length up to which recent tokens were copied in
        self.selections = 0
        self._plan: str = "full"

    @property
    def active(self) -> bool:
        return self.full.length > self.budget

    def begin(self, n: int) -> None:
        L = self.full.length
        if L <= self.budget:
            # Short sequences: the partial cache *is* the full cache (no error, unlike the paper's code).
            self._plan = "full"
            self.full.begin(n)
        elif self.selected_at is None or L - self.selected_at > self.budget - self.SINKS:
            self._plan = "select"
        else:
            self._plan = "sync"
        if n > self.slots - self.budget:
            raise ValueError(f"draft pass of {n} tokens exceeds the partial cache's spare slots")
        self.n_new = n

    def visible_past(self) -> int:
        return self.full.length if self._plan == "full" else self.budget

    def keys(self) -> Tensor:
        """Every layer's keys as [layers, kv_heads, slots, d] (a copy where they are stored in tiles)."""
        return logical_keys(self.k, self.slots)

    def attention_mask(self, n: int, block_mask: Tensor | None, positions: Tensor,
                       sliding_window: int | None = None) -> Tensor | None:
        return KVCache.attention_mask(self, n, block_mask, positions, None)  # type: ignore[arg-type]

    def write(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._plan == "full":
            return self.full.write(layer, q, k, v)
        L, B = self.full.length, self.budget
        if self._plan == "select":
            self._select(layer, q[:, -1], L)
        else:
            self._sync(layer, L)
        n = k.shape[1]
        put_key_slots(self.k[layer], B, k)
        self.v[layer, :, B:B + n] = v
        if layer == self.k.shape[0] - 1:
            if self._plan == "select":
                self.selected_at, self.synced, self.selections = L, L, self.selections + 1
            else:
                self.synced = L
        return attended_keys(self.k[layer], B + n), self.v[layer, :, :B + n]

    def _select(self, layer: int, q: Tensor, L: int) -> None:
        keys = key_slots(self.full.k[layer], 0, L)  # [kv_heads, L, d]
        n_kv = keys.shape[0]
        # Raw dot-product scores of the latest query, summed over the query heads that share each KV head.
        scores = torch.einsum("gd,gld->gl", q.reshape(n_kv, -1, q.shape[-1]).sum(1), keys.to(q.dtype))
        S = self.SINKS
        top = scores[:, S:].topk(self.budget - S, dim=-1).indices + S  # sorted by score, best first
        idx = torch.cat([torch.arange(S, device=keys.device).expand(n_kv, S), top], dim=1)
        gather = idx[:, :, None].expand(-1, -1, keys.shape[-1])
        put_key_slots(self.k[layer], 0, keys.gather(1, gather))
        self.v[layer, :, :self.budget] = self.full.v[layer, :, :L].gather(1, gather)

    def _sync(self, layer: int, L: int) -> None:
        # Tokens committed since the selection overwrite the lowest-scored slots, newest at the end.
        assert self.selected_at is not None
        lo, hi = self.synced, L
        if hi > lo:
            B, m0 = self.budget, self.synced - self.selected_at
            dst = slice(B - (hi - self.selected_at), B - m0)
            put_key_slots(self.k[layer], dst.start, key_slots(self.full.k[layer], lo, hi).flip(1))
            self.v[layer, :, dst] = self.full.v[layer, :, lo:hi].flip(1)

    def commit(self) -> None:
        # Drafting never commits: the verification pass writes the authoritative keys into the full cache.
        self.n_new = 0

    rollback = commit
