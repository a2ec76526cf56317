"""Schemathesis hooks for the Kvasir contract test (loaded through schemathesis.toml).

A `kvr1...` address is bech32m with a checksum, which no JSON Schema `pattern` can express:
strings that merely match the pattern are rejected with 400, as they should be. Where the
document marks a string `format: kvr-address`, this strategy draws real addresses instead
(32 random bytes, bech32m-encoded under the `kvr` prefix), so positive tests reach the
handler's logic. Negative tests still draw strings that break the pattern.
"""

import schemathesis
from hypothesis import strategies as st

_CHARSET = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"
_BECH32M_CONST = 0x2BC830A3


def _polymod(values):
    generator = [0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3]
    chk = 1
    for value in values:
        top = chk >> 25
        chk = (chk & 0x1FFFFFF) << 5 ^ value
        for i in range(5):
            chk ^= generator[i] if ((top >> i) & 1) else 0
    return chk


def _hrp_expand(hrp):
    return [ord(c) >> 5 for c in hrp] + [0] + [ord(c) & 31 for c in hrp]


def _to_5bit(data):
    acc, bits, out = 0, 0, []
    for byte in data:
        acc = (acc << 8) | byte
        bits += 8
        while bits >= 5:
            bits -= 5
            out.append((acc >> bits) & 31)
    if bits:
        out.append((acc << (5 - bits)) & 31)
    return out


def kvr_address(key: bytes, hrp: str = "kvr") -> str:
    data = _to_5bit(key)
    polymod = _polymod(_hrp_expand(hrp) + data + [0] * 6) ^ _BECH32M_CONST
    checksum = [(polymod >> 5 * (5 - i)) & 31 for i in range(6)]
    return hrp + "1" + "".join(_CHARSET[d] for d in data + checksum)


# The dev chain's faucet address: keeps the encoder honest against one the ledger accepts.
assert (
    kvr_address(bytes.fromhex("88268823eecc95714dd844d295c6ad066c5653b53846ca343bbbeba6f5265f90"))
    == "kvr13qngsglwej2hznwcgnfft34dqek9v5a48prv5dpmh046dafxt7gqgxsvck"
)

schemathesis.openapi.format("kvr-address", st.binary(min_size=32, max_size=32).map(kvr_address))
