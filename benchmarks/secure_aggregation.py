"""What secure aggregation costs, in one process: the cryptography and the bytes of one SecAgg+ round
(`common.secagg`) against a plain round's, at 8 and 100 devices, with none and 10% of them dropping out after they
shared their keys.

Run as ``.venv/bin/python benchmarks/secure_aggregation.py [--params N] [--devices 8,100] [--repeat 3]`` (a
benchmark: it prints, never fails on a number; each time is the least of ``--repeat`` rounds). The model is ``N`` float32 parameters in two tensors (default 272,474: PreResNet-20's
size), held in HeteroFL's width slices (a third of the devices each at widths 1, 1/2, 1/4 of the rows). Per round it
prints:

- **device seconds**: one device's advert, sharing (Shamir splits and sealing to each neighbour), masking (its self
  mask and a pair mask per neighbour, each drawn over the global tensors) and giving shares back, the largest over
  the devices (each device works in parallel with the others: this is the round's added latency on a device of this
  machine's speed);
- **coordinator seconds**: the roster, relaying, summing the masked slices and unmasking, against summing the plain
  float32 slices;
- **bytes per device**: what a device sends and receives beyond its task (adverts, rosters, sealed shares, the masked
  slice's 8 bytes a value against 4 for float32, shares given back), counted as raw payload (keys, ciphertexts,
  values; the msgpack framing adds a few bytes a field), against the plain update's.

The transport (MQTT round trips: three more per round, advert -> roster, shares -> relay, request -> reveal) is not
in these figures; a run over mosquitto is the next step.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence

import numpy as np

from common.secagg.client import SHARE_BYTES, SecureClient
from common.secagg.server import SecureServer

KEY_BYTES = 32
SEALED_BYTES = 12 + 2 * SHARE_BYTES + 16  # nonce, the two shares, the tag


def fleet(devices: int, params: int) -> tuple[dict[str, tuple[int, ...]], dict[str, dict[str, list[np.ndarray]]]]:
    columns = 64
    rows = max(4, params // columns)
    shapes = {"w": (rows, columns), "b": (rows,)}
    widths = (1.0, 0.5, 0.25)
    coverages = {}
    for index in range(devices):
        kept = np.arange(max(1, int(rows * widths[index % 3])))
        coverages[f"d{index:03d}"] = {"w": [kept, np.arange(columns)], "b": [kept]}
    return shapes, coverages


def one_round(devices: int, params: int, dropout: float, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    shapes, coverages = fleet(devices, params)
    values = {name: {key: rng.normal(size=tuple(len(i) for i in idx)) for key, idx in cov.items()}
              for name, cov in coverages.items()}
    context = b"bench:round-1"
    clients = {name: SecureClient(name, context) for name in coverages}
    server = SecureServer(context, shapes, coverages, random.Random(seed))
    device_seconds: dict[str, float] = dict.fromkeys(coverages, 0.0)
    started = time.perf_counter()
    adverts = {}
    for name, client in clients.items():
        tick = time.perf_counter()
        adverts[name] = client.advert()
        device_seconds[name] += time.perf_counter() - tick
    tick = time.perf_counter()
    rosters = server.rosters(adverts)
    coordinator = time.perf_counter() - tick
    bundles = {}
    for name, client in clients.items():
        tick = time.perf_counter()
        bundles[name] = client.share(rosters[name])
        device_seconds[name] += time.perf_counter() - tick
    tick = time.perf_counter()
    relayed = server.relay(bundles)
    coordinator += time.perf_counter() - tick
    # The dropped are drawn among the narrowest devices: at 8 devices a dropped full-width one would leave its rows
    # to two senders, and the round would rightly not be unmasked (common.secagg.server.SecureServer.request).
    narrow = sorted(name for index, name in enumerate(sorted(clients)) if index % 3 == 2)
    dropped = set(random.Random(seed).sample(narrow, round(dropout * devices)))
    tick = time.perf_counter()
    keep = server.keep()
    coordinator += time.perf_counter() - tick
    masked_bytes = 0
    for name, client in clients.items():
        tick = time.perf_counter()
        client.receive(relayed[name])
        if name not in dropped:
            masked = client.mask(values[name], coverages[name], shapes, keep[name])
            masked_bytes = max(masked_bytes, sum(array.nbytes for array in masked.values()))
        device_seconds[name] += time.perf_counter() - tick
        if name not in dropped:
            tick = time.perf_counter()
            server.add(name, masked)
            coordinator += time.perf_counter() - tick
    tick = time.perf_counter()
    survivors, gone = server.request()
    coordinator += time.perf_counter() - tick
    reveals = {}
    for name in survivors:
        tick = time.perf_counter()
        reveals[name] = clients[name].reveal(survivors, gone)
        device_seconds[name] += time.perf_counter() - tick
    tick = time.perf_counter()
    server.unmask(reveals)
    coordinator += time.perf_counter() - tick
    # The plain round's coordinator work: the float32 slices summed into the global tensors.
    tick = time.perf_counter()
    sums = {key: np.zeros(shape, dtype=np.float32) for key, shape in shapes.items()}
    for name in survivors:
        for key, idx in coverages[name].items():
            sums[key][np.ix_(*idx)] += values[name][key].astype(np.float32)
    plain = time.perf_counter() - tick
    neighbours = len(rosters[survivors[0]].neighbours)
    widest = max(survivors, key=lambda name: sum(len(idx[0]) for idx in coverages[name].values()))
    plain_bytes = sum(values[widest][key].size * 4 for key in shapes)
    secure_bytes = (2 * KEY_BYTES  # advert
                    + neighbours * (2 * KEY_BYTES + 8)  # roster: each neighbour's keys and point (its slice: its spec)
                    + 2 * neighbours * SEALED_BYTES  # shares sealed out, and those relayed in
                    + masked_bytes + (len(survivors) + len(gone)) * 8  # the masked slice; the request's names
                    + neighbours * (SHARE_BYTES + 16))  # shares given back
    return {"devices": devices, "dropped": len(dropped), "neighbours": neighbours, "threshold": server.threshold,
            "device_s": max(device_seconds.values()), "coordinator_s": coordinator, "plain_coordinator_s": plain,
            "secure_bytes": secure_bytes, "plain_bytes": plain_bytes, "wall_s": time.perf_counter() - started}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=272_474)
    parser.add_argument("--devices", default="8,100")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per row; the times are their least")
    args = parser.parse_args(argv)
    print(f"secure aggregation, one round, {args.params:,} parameters, HeteroFL's width slices (1, 1/2, 1/4)")
    one_round(4, 1000, 0.0, seed=0)  # warm-up: the first key agreement and cipher set-up load their code
    print("devices  dropped  neighbours  threshold  device s  coordinator s (plain)  bytes/device (plain)  ratio")
    for devices in (int(value) for value in args.devices.split(",")):
        for dropout in (0.0, 0.1):
            runs = [one_round(devices, args.params, dropout, seed=devices + repeat) for repeat in range(args.repeat)]
            r = {**runs[0], **{key: min(run[key] for run in runs)
                               for key in ("device_s", "coordinator_s", "plain_coordinator_s")}}
            print(f"{r['devices']:7d}  {r['dropped']:7d}  {r['neighbours']:10d}  {r['threshold']:9d}  "
                  f"{r['device_s']:8.3f}  {r['coordinator_s']:8.3f} ({r['plain_coordinator_s']:.3f})        "
                  f"{r['secure_bytes'] / 1e6:8.2f} MB ({r['plain_bytes'] / 1e6:.2f})      "
                  f"{r['secure_bytes'] / r['plain_bytes']:.2f}x")


if __name__ == "__main__":
    main()
