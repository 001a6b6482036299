"""Inductor's on-disk graph cache is shared by every process of a user, and keyed without
the vector ISA its CPU kernels are generated for: a graph compiled by a process on AVX-512
was served to an ATEN_CPU_CAPABILITY=avx2 process (and the other way round), whose kernels
then stored vectors of the wrong width (half of every output unwritten here; 8 floats past
every buffer the other way, the heap corruption of `generation.compile = on` beside a CI
run under avx2). `compiled_decode._compiled` puts the width in the key.

Real inductor in two processes over one cache directory (tens of seconds of gcc): only on
a CPU with vectors wider than AVX2's, where the two widths differ."""

import os
import subprocess
import sys

import pytest
from torch._inductor.cpu_vec_isa import pick_vec_isa, valid_vec_isa_list

from rlhf_async.modeling import compiled_decode as cd

# a vectorized loop with a tail, through the graph maker of the compiled decode step; prints
# how many of its 1000 outputs are wrong and the vector width this process picked
_PROBE = """
import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa
from rlhf_async.modeling import compiled_decode as cd
f = cd._compiled(("isa-probe",), lambda: (lambda x: x * 2 + 1))
y = f(torch.ones(1000))
print(int((y != 3).sum()), pick_vec_isa().bit_width())
"""


def _probe(cache: str, capability: str | None) -> tuple[int, int]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_COMPILE_THREADS": "1",  # no pool of compile workers to start
           "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    wrong, width = out.stdout.split()[-2:]
    return int(wrong), int(width)


@pytest.mark.slow
@pytest.mark.skipif(max((isa.bit_width() for isa in valid_vec_isa_list()), default=0) <= 256,
                    reason="no vector ISA wider than AVX2's here: both processes pick one width")
def test_a_graph_cached_by_a_wider_isa_is_not_served_to_avx2(tmp_path):
    cache = str(tmp_path / "inductor")
    wrong, width = _probe(cache, None)  # the CPU's best (AVX-512): compiled, cached
    assert wrong == 0 and width > 256
    wrong, width = _probe(cache, "avx2")  # the same graph under AVX2
    assert width == 256
    assert wrong == 0, f"{wrong} of 1000 outputs wrong: served the wider ISA's kernels"


def test_the_vector_width_is_a_compile_option(monkeypatch):
    """The width goes to inductor as an option (part of its cache key); other backends take
    none."""
    assert cd._inductor_options() == {"cpp.simdlen": pick_vec_isa().bit_width()}
    monkeypatch.setattr(cd, "BACKEND", "eager")
    assert cd._inductor_options() is None
