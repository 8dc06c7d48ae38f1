"""The estimate under `--cpu_offload`: a device column and a host column.

`moments.py` walks a step and says, term by term, what is alive at each moment. With CPU offload
(`parallel/offload.py`) some of those terms live in host memory instead: this module sorts them
and gives each side its own peak, which need not fall at the same moment (the device peaks in
forward or backward, with the activations; the host in the optimizer step, with its temporary).

    host, every strategy      optimizer_states (Adam's m and v, and the fp32 master where it is
                              not the parameter itself), the optimizer step's temporary
    host, ZeRO-2              gradients: each shard's, copied out once reduced
    host, FSDP                parameters (the fp32 shard is the master), the gradient shards
                              copied out ("host gradients"; at the step, "gradients")
    device                    everything else: the model's weights (ZeRO), FSDP's compute-dtype
                              shard (`DeviceCopy`; not FSDP2's, which copies its shard to the
                              device at each all-gather), gathered units, buckets, activations

The device column is the one that must fit in a GPU: under offload the estimate's `peak` is it
(so `--gpu_memory` and the largest batch read it), and `host` is the other side's. PCIe bytes
per step: `pcie_bytes`. Measured on CPU ranks by `memory/sides.py`; tests/parallel/test_offload.py holds
the two together.
"""

import math

HOST = {"optimizer_states", "optimizer step temporary", "host gradients"}
HOST_BY_STRATEGY = {"zero2": {"gradients"}, "fsdp": {"parameters"}}


def _shard(s, setup) -> int:
    return math.ceil(s.num_params / setup.world_size)


def device_copy(s, setup) -> int:
    """FSDP by hand: the compute-dtype copy of the shard the device keeps to all-gather from."""
    if setup.strategy != "fsdp" or setup.options.impl != "minidist":
        return 0
    return (2 if setup.options.mixed_precision == "bf16" else 4) * _shard(s, setup)


def host_terms(setup, moment: str) -> set:
    """The terms of `moment` that live on the host side."""
    terms = HOST | HOST_BY_STRATEGY.get(setup.strategy, set())
    if setup.strategy == "fsdp" and moment == "step":  # the gradient shards, by now all copied out
        terms = terms | {"gradients"}
    return terms


def sides(s, setup, at: dict) -> dict:
    """{"device": peak bytes, "host": peak bytes, and the moment of each} from `moments.moments`."""
    copy = device_copy(s, setup)
    device = {m: sum(v for k, v in terms.items() if k not in host_terms(setup, m)) + copy for m, terms in at.items()}
    host = {m: sum(v for k, v in terms.items() if k in host_terms(setup, m)) for m, terms in at.items()}
    on_device, on_host = max(device, key=device.get), max(host, key=host.get)
    return {"device": device[on_device], "host": host[on_host], "device_moment": on_device, "host_moment": on_host,
            "device_shard": copy}


def side(term: str, setup) -> str:
    """"device" or "host": the side of one of the estimate's terms (`estimate`'s keys) under offload."""
    host = HOST | HOST_BY_STRATEGY.get(setup.strategy, set()) | {"optimizer_step"}
    if setup.strategy == "fsdp":
        host = host | {"gradients"}
    return "host" if term in host else "device"


def columns(s, setup, terms: dict) -> list[tuple[str, int, str]]:
    """(term, bytes, side) for the report's table, with FSDP's device shard."""
    rows = [(k, v, side(k, setup)) for k, v in terms.items() if k not in ("peak", "device", "host")]
    rows.insert(3, ("device_shard", device_copy(s, setup), "device"))
    return rows


def pcie_bytes(s, setup) -> dict:
    """Bytes one rank moves over the host link per optimizer step: its shard's gradient out, the
    updated weights back (ZeRO: its shard in the weights' dtype, then all-gathered on the device;
    FSDP by hand: its compute-dtype shard once; both cast on the host before they are sent,
    `offload.to_device`; FSDP2: its fp32 shard at each of the 2 all-gathers of a step, cast on the
    device)."""
    shard, bf16 = _shard(s, setup), setup.options.mixed_precision == "bf16"
    w = 2 if bf16 else 4
    if setup.strategy == "fsdp":
        to_host = 4 * shard  # the fp32 reduce-scatter output
        to_device = w * shard if setup.options.impl == "minidist" else 2 * 4 * shard
    else:
        to_host = w * shard  # ZeRO-2's shard in the gradient's dtype; ZeRO-1's slice of the flat gradient
        to_device = w * shard
    return {"device_to_host": to_host, "host_to_device": to_device}
