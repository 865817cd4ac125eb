"""Copies cut into pieces of about a given size, so a long copy can report progress between them."""

from __future__ import annotations

import torch


def pieces(
    dst: list[torch.Tensor], src: list[torch.Tensor], piece_bytes: int
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """``dst <- src`` as groups of about ``piece_bytes`` (one fused copy each); a tensor larger
    than that is cut along its flat view where both sides allow it."""
    out: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], [])]
    size = 0
    for d, s in zip(dst, src):
        nbytes = s.numel() * s.element_size()
        if nbytes > piece_bytes and d.is_contiguous() and s.is_contiguous() and d.numel() == s.numel():
            step = max(1, piece_bytes // s.element_size())
            flat_d, flat_s = d.view(-1), s.view(-1)
            out += [([flat_d[a : a + step]], [flat_s[a : a + step]]) for a in range(0, s.numel(), step)]
            out.append(([], []))
            size = 0
            continue
        if size and size + nbytes > piece_bytes:
            out.append(([], []))
            size = 0
        out[-1][0].append(d)
        out[-1][1].append(s)
        size += nbytes
    return [group for group in out if group[0]]
