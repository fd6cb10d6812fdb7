"""HS201: ``d["key"]`` of a dict parameter is a device tensor when the linted modules write out
dicts that could be ``d`` (their string keys cover every key the function subscripts ``d``
with), and each gives ``key`` a device tensor, and no ``x["key"] = v`` store gives it another
value: a KV cache a pipeline builds on the device, read by an attention layer. A dict of other
keys (an update record holding a Python int under the same key) is not the cache; a key some
dict of the cache's keys holds otherwise is unknown."""
import torch


class Pipeline:
    """Builds the caches on the device it serves (a method's device parameter)."""

    def make_cache(self, n: int, device: torch.device) -> dict:
        return {
            "k": torch.zeros(n, 8, device=device),
            "end": torch.tensor([0], dtype=torch.long, device=device),
            "count": torch.tensor([0], dtype=torch.long, device=device),
        }

    def make_counted_cache(self, n: int, device: torch.device) -> dict:
        # the same keys, "count" a Python int here: that entry is unknown
        return {"k": torch.zeros(n, 8, device=device),
                "end": torch.tensor([0], dtype=torch.long, device=device), "count": 0}


def make_host_cache(n: int) -> dict:
    return {"k": torch.zeros(n, 8), "step": torch.zeros(1)}


def renamed(cache: dict) -> dict:
    # a view of the cache under other keys: device entries, as the cache's are
    return {"k2": cache["k"], "end2": cache["end"], "count2": cache["count"]}


def attend(q: torch.Tensor, cache: dict) -> tuple[int, dict]:
    end = cache["end"].item()  # expect: HS201
    n = cache["count"].item()  # a Python int in one cache of these keys: unknown
    size = cache["k"].shape[0]
    info = {"end": end, "size": size}  # an update record: other keys, not the cache
    return n, info


def attend_renamed(cache: dict) -> int:
    return cache["end2"].item() + cache["k2"].shape[0]  # expect: HS201


def stepped(cache: dict) -> int:
    return cache["step"].item() + cache["k"].shape[0]  # the host cache's keys: no device fact


def overwritten(state: dict, n: int) -> int:
    state["pos"] = n  # a Python int stored under "pos": no fact for the key
    return state["pos"].item()


def built() -> dict:
    return {"pos": torch.zeros(1, device="cuda"), "k": torch.zeros(1, device="cuda")}
