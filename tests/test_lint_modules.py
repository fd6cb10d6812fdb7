"""Cross-module summaries (hostsync.lint_modules): files linted together know what the
functions and classes they import from each other return."""

from __future__ import annotations

import pathlib

from hostsync.lint_cli import collect_rooted, lint_files
from hostsync.lint_modules import module_name

HELPERS = """\
import torch
from .use import consume  # a cycle: summaries are local facts, so it costs nothing


def make(n):
    return torch.zeros(n, device="cuda")


def host(n):
    return torch.arange(n)


def sample(logits, temps_gpu):
    out = kernel(logits, temps_gpu)  # a call given device tensors
    return out.view(-1), out.argmax(-1)


class Pool:
    def take(self, n):
        return torch.empty(n, device="cuda")
"""

USE = """\
import pkg.helpers
from pkg import helpers
from .helpers import Pool, make, sample


def consume(n):
    a = make(n).item()                                    # HS201
    b = helpers.host(n).to("cuda", non_blocking=True)     # HS101
    c = pkg.helpers.host(n).cuda(non_blocking=True)       # HS101
    pool = Pool()
    d = pool.take(n).tolist()                             # HS201
    ids, probs = sample(n, n)
    e = ids.cpu()                                         # HS201: a tuple item
    return a, b, c, d, e
"""


def _tree(tmp_path: pathlib.Path) -> pathlib.Path:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text(HELPERS)
    (pkg / "use.py").write_text(USE)
    (pkg / "broken.py").write_text("def f(:\n")
    return pkg


def _lint_package(tmp_path: pathlib.Path, modules: dict[str, str],
                  codes: list[str]) -> tuple[pathlib.Path, list[tuple[str, int, str]]]:
    """The package ``pkg`` of these modules under ``tmp_path``, linted from ``tmp_path``:
    (its directory, the findings as (file name, line, code))."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in modules.items():
        (pkg / name).write_text(text)
    return pkg, [(pathlib.Path(f.path).name, f.line, f.code)
                 for f in lint_files(collect_rooted([str(tmp_path)], []), codes)]


def test_imports_resolve_against_the_other_linted_files(tmp_path: pathlib.Path) -> None:
    pkg = _tree(tmp_path)
    found = [(pathlib.Path(f.path).name, f.line, f.code)
             for f in lint_files(collect_rooted([str(tmp_path)], []), ["HS"])]
    assert found == [("broken.py", 1, "HS000"), ("use.py", 7, "HS201"), ("use.py", 8, "HS101"),
                     ("use.py", 9, "HS101"), ("use.py", 11, "HS201"), ("use.py", 13, "HS201")]
    # the package given itself: names come from the enclosing packages (__init__.py)
    assert [f.code for f in lint_files(collect_rooted([str(pkg)], []), ["HS"])] == \
        ["HS000", "HS201", "HS101", "HS101", "HS201", "HS201"]
    # alone, use.py cannot see into its helpers: nothing to report
    assert lint_files([str(pkg / "use.py")], ["HS"]) == []


def test_module_names(tmp_path: pathlib.Path) -> None:
    pkg = _tree(tmp_path)
    assert module_name(str(pkg / "use.py"), str(tmp_path)) == "pkg.use"
    assert module_name(str(pkg / "use.py"), str(pkg)) == "pkg.use"
    assert module_name(str(pkg / "__init__.py"), str(tmp_path)) == "pkg"
    assert module_name(str(pkg / "use.py")) == "pkg.use"


def test_an_import_never_resolves_to_a_shorter_namesake(tmp_path: pathlib.Path) -> None:
    """``vllm.v1.worker.utils`` is not the linted ``vllm_ascend/worker/utils.py``; a source
    directory above the package (``python/minisgl``) is fine."""
    helpers = HELPERS.replace("from .use import consume", "")
    for helper, main, imp in (("vllm_ascend/worker/utils.py", "vllm_ascend/main.py",
                               "vllm.v1.worker.utils"),
                              ("python/minisgl/utils.py", "python/minisgl/main.py",
                               "minisgl.utils")):
        for path, text in ((helper, helpers), (main, f"from {imp} import make\n\n\n"
                                                     "def f(n):\n    return make(n).item()\n")):
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(text)
    found = [f.path for f in lint_files(collect_rooted([str(tmp_path)], []), ["HS"])]
    assert found == [str(tmp_path / "python" / "minisgl" / "main.py")]


def test_tuple_items_of_a_guessed_method_result_stay_unknown(tmp_path: pathlib.Path) -> None:
    """``_, counts, mode = self.sync(x_gpu)``: a method whose summary is unknown is only guessed
    to return device results; its tuple's items are not taken to be (vllm-ascend's
    ``_sync_metadata_across_dp`` returns a host tensor there)."""
    path = tmp_path / "runner.py"
    path.write_text("class R:\n    def sync(self, n):\n        return n, None, 0\n\n"
                    "    def step(self, x_gpu):\n        _, counts, _ = self.sync(x_gpu)\n"
                    "        return counts.item()\n")
    assert lint_files([str(path)], ["HS"]) == []


def test_a_device_hint_outweighs_a_guessed_call_result(tmp_path: pathlib.Path) -> None:
    """``q, k = rope(q, k)`` (a guess: dev-call) then ``lens.to(q.device)``: ``q.device`` used
    as a device says ``q`` is on the device (lightllm qwen2_5_visual)."""
    path = tmp_path / "vis.py"
    path.write_text("def rope(q, k):\n    return q.float(), k.float()\n\n\n"
                    "class Attn:\n    def forward(self, x_gpu, lens):\n"
                    "        q, k = rope(self.qkv(x_gpu), x_gpu)\n"
                    "        lens = lens.to(q.device)\n        return lens.max().item()\n")
    assert [f.line for f in lint_files([str(path)], ["HS"])] == [9]


CALLEES = """\
import torch


def top_tokens(logprobs, accepted):
    ids = accepted.tolist()     # HS201: every caller passes a device tensor
    if accepted.any():          # HS201: strictly so (made with device=)
        pass
    return ids


def host_helper(lens):
    return lens.tolist()        # a caller passes a host tensor


def mixed(lens):
    return lens.tolist()        # a caller passes what the lint cannot place


def escaped(lens):
    return lens.tolist()        # also bound to a name: its other callers are unseen


def spread(lens):
    return lens.tolist()        # also called with *args


def first(tensors):
    if tensors:                 # a list of device tensors is no tensor
        return tensors[0]


class Helper:
    def accept(self, draft):
        return draft.cpu()      # HS201: `obj.accept(dev)` at every call of the name

    def forward(self, x):
        return x.cpu()          # an nn.Module's forward is called by module(x) too
"""

CALLERS = """\
import torch
from .callees import Helper, escaped, first, host_helper, mixed, spread, top_tokens


def step(logits, n, helper, other, args):
    lp = torch.log_softmax(logits.cuda(), -1)
    acc = torch.ones(n, device="cuda")
    top_tokens(lp, acc)
    top_tokens(lp, accepted=acc + 1)
    host_helper(torch.arange(n))
    host_helper(acc)
    mixed(acc)
    mixed(other)
    escaped(acc)
    f = escaped
    spread(acc)
    spread(*args)
    helper.accept(acc)
    Helper().forward(acc)
    first([acc, acc])
    return f
"""


def test_a_parameter_every_call_site_gives_a_device_tensor(tmp_path: pathlib.Path) -> None:
    """Call-site parameter facts (TGI's ``batch_top_tokens(..., logprobs, accepted_ids)``,
    called from the model files with device tensors): host, unknown, hidden (``*args``) or
    unseen callers (a function used as a value, ``forward``) leave the parameter unknown, and a
    list of device tensors is no tensor (lightllm ``torch_cat_3([a, b])``: ``if tensors:``)."""
    pkg, found = _lint_package(tmp_path, {"callees.py": CALLEES, "callers.py": CALLERS}, ["HS"])
    assert found == [("callees.py", 5, "HS201"), ("callees.py", 6, "HS201"),
                     ("callees.py", 34, "HS201")]
    # alone, the callees' parameters are unknown
    assert lint_files([str(pkg / "callees.py")], ["HS"]) == []


UPLOADS = '''import torch


def upload(x, device):
    return x.to(device, non_blocking=True)


def upload_kw(x, *, device):
    y = x.to(device=device, non_blocking=True)
    return y


def upload_mixed(x, device):
    return x.to(device, non_blocking=True)
'''

UPLOADERS = '''import torch
from .uploads import upload, upload_kw, upload_mixed


class Runner:
    def __init__(self, device):
        self.device = device

    def step(self, n):
        a = upload(torch.arange(n), self.device)
        b = upload_kw(torch.zeros(n), device=self.device)
        c = upload_mixed(torch.zeros(n), self.device)
        d = upload_mixed(torch.zeros(n, pin_memory=True), self.device)
        return a, b, c, d
'''


def test_a_free_function_uploading_its_argument_to_a_device_parameter(
        tmp_path: pathlib.Path) -> None:
    """A free function that uploads a parameter to a device parameter
    (``def upload(x, device): return x.to(device, non_blocking=True)``): where every caller
    passes a pageable host tensor, the upload site is HS101; one pinned argument among the
    callers leaves the parameter unknown (no finding, and no HS103 at the upload either way:
    the device is the caller's)."""
    pkg, found = _lint_package(tmp_path, {"uploads.py": UPLOADS, "uploaders.py": UPLOADERS},
                               ["HS101", "HS201"])
    assert found == [("uploads.py", 5, "HS101"), ("uploads.py", 9, "HS101")]
    assert lint_files([str(pkg / "uploads.py")], ["HS101", "HS201"]) == []


PIPELINE = '''import torch


class Pipeline:
    def caches(self, n, device):
        return [{"k": torch.zeros(n, 8, device=device),
                 "end": torch.tensor([0], device=device)} for _ in range(4)]
'''

LAYER = '''def attend(q, cache):
    end = cache["end"].item()
    return q[:, : cache["k"].shape[0]], end
'''


def test_a_dict_entry_every_linted_module_writes_on_the_device(tmp_path: pathlib.Path) -> None:
    """A cache dict a pipeline module writes out on the device, read by a layer of another
    module through a parameter (FastVideo's KV caches' ``global_end_index``): found when the
    two are linted together, not when the layer is linted alone."""
    pkg, found = _lint_package(tmp_path, {"pipeline.py": PIPELINE, "layer.py": LAYER}, ["HS"])
    assert found == [("layer.py", 2, "HS201")]
    assert lint_files([str(pkg / "layer.py")], ["HS"]) == []


FIELDS = '''import torch


class Pipeline:
    def _split_masked(self, hidden, mask):
        lengths = mask.bool().sum(dim=1)
        return torch.split(hidden[mask.bool()], lengths.tolist(), dim=0)

    def encode(self, prompts, hidden):
        tokens = self.tokenizer(prompts, return_tensors="pt").to(self.device)
        return self._split_masked(hidden, tokens.attention_mask)

    def encode_on_host(self, prompts, hidden):
        tokens = self.tokenizer(prompts, return_tensors="pt")
        return self._split_masked(hidden, tokens.attention_mask)
'''


def test_a_field_of_a_value_on_the_device_passed_to_a_helper(tmp_path: pathlib.Path) -> None:
    """``tokens = tokenizer(...).to(device)`` ... ``self._split_masked(h,
    tokens.attention_mask)``: the field is a device tensor, so where every call site passes
    one the helper's ``.tolist()`` reads the device (vllm-omni's Qwen-Image pipeline); a call
    site that passes the encoding's field from the host leaves the parameter unknown."""
    _, found = _lint_package(tmp_path, {"pipe.py": FIELDS}, ["HS"])
    assert found == []
    one = FIELDS.replace('''
    def encode_on_host(self, prompts, hidden):
        tokens = self.tokenizer(prompts, return_tensors="pt")
        return self._split_masked(hidden, tokens.attention_mask)
''', "")
    (tmp_path / "pkg" / "pipe.py").write_text(one)
    found = [(pathlib.Path(f.path).name, f.line, f.code)
             for f in lint_files(collect_rooted([str(tmp_path)], []), ["HS"])]
    assert found == [("pipe.py", 7, "HS201")]
