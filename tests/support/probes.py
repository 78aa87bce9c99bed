"""Probes the encoders refuse to build: a probe's bytes signed with a key, whatever its padding
(encoders refuse > MAX_PAD)."""
from __future__ import annotations


def signed_probe(key: bytes, p, src: bytes, dst: bytes, sport: int, dport: int = 4791) -> bytes:
    """The UDP payload of probe `p` (a wire.Probe) with a valid tag and ICRC under `key`, built
    without the encoder's bounds: what a peer holding the key could send."""
    import hashlib

    from linkpass.core import wire as W

    bth = W._BTH.pack(W.BTH_OPCODE_RC_SEND_ONLY, 0, W.PKEY_DEFAULT, W.LINKPASS_QPN, p.seq & 0xFFFFFF)
    body = W._HDR.pack(W.MAGIC, W.VERSION, p.kind, p.flags, 0, p.pad, p.sender, p.reflector, p.path, p.rx_count,
                       p.seq, p.t1, p.t2, p.t3, p.t4) + bytes(p.pad)
    roce = bth + body + hashlib.blake2b(body, key=key, digest_size=W.TAG_LEN).digest()
    return roce + W.icrc(src, dst, sport, dport, roce)
