#!/usr/bin/env bash
# The peers' packages for bench/gpu_real.sh, carried as wheels to a machine that reaches no package index.
#   bench/peers.sh download [PYVER]  # on a machine with an index: wheels into .whl/trl011 and .whl/trl116
#                                    # (PYVER: the target machine's Python, e.g. 3.12; default this python3's)
#   bench/peers.sh install DIR       # anywhere, no index: pip --target DIR/trl011 and DIR/trl116 from .whl
# Each peer lives in its own --target directory, put first on PYTHONPATH by its worker only, over the machine's
# own torch, numpy, pyarrow and the rest:
#   trl011: TRL 0.11.4, the last with the legacy PPOTrainer, with the transformers it was released against (4.46.3)
#           and that one's tokenizers and huggingface_hub (transformers 4.46 refuses newer ones at import);
#   trl116: TRL 1.16's GRPOTrainer on the machine's own transformers 5, plus datasets (which TRL imports).
# .whl/ is ignored by git (.git/info/exclude); the device tool's `carry: [.whl]` takes it along.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHL=${WHL:-.whl}  # where the wheels are kept
TRL011=(trl==0.11.4 transformers==4.46.3 tokenizers==0.20.3 huggingface_hub==0.26.5 accelerate==1.2.1
        datasets==3.1.0 fsspec==2024.9.0 dill==0.3.8 multiprocess==0.70.16
        tyro==0.8.14 docstring_parser==0.16 shtab==1.7.1 typeguard==4.4.1 rich==13.9.4)  # trl 0.11's config imports tyro
TRL116=(trl==1.16.0 datasets==4.8.0 dill==0.4.1 multiprocess==0.70.19  # datasets 4.8: pyarrow>=21, hub<2
        httpx==0.28.1 httpcore==1.0.9)  # datasets imports httpx, which not every machine has

case "${1:-}" in
  download)
    pyver=${2:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
             manylinux1_x86_64; do platforms+=(--platform "$p"); done
    for peer in trl011 trl116; do
      rm -rf "$WHL/$peer" && mkdir -p "$WHL/$peer"
      if [ "$peer" = trl011 ]; then pins=("${TRL011[@]}"); else pins=("${TRL116[@]}"); fi
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        "${platforms[@]}" -d "$WHL/$peer" "${pins[@]}"
    done
    # keep the default .whl/ out of git, where this is a checkout with its own .git/info (a CI copy may have none)
    if [ "$WHL" = .whl ] && [ -d .git/info ]; then
      grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    fi
    du -sh "$WHL"/* ;;
  install)
    dest=${2:?usage: bench/peers.sh install DIR}
    for peer in trl011 trl116; do
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dest/$peer" \
        "$WHL/$peer"/*.whl
    done ;;
  *) echo "usage: bench/peers.sh download [PYVER] | install DIR" >&2; exit 2 ;;
esac
