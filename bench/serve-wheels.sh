#!/usr/bin/env bash
# The wheels bench/device-serve.sh installs on the GPU machine (no network there): guidellm and
# what it needs that the machine's image lacks (/work/.library/device/KINDS.md lists what it has:
# torch, transformers, huggingface-hub, httpx, numpy, pandas, pyarrow, rich, uvloop, ...), for
# CPython 3.12 on manylinux x86-64, one version of each. click and typing-extensions are carried
# too because guidellm and pydantic pin versions (click~=8.4.0, typing-extensions>=4.16) that
# the image may not have; carried wheels come first on PYTHONPATH.
#
#   bash bench/serve-wheels.sh [DIR]      # default .whl (list /.whl/ in .git/info/exclude)
#   then on the GPU machine: python3 -m pip install -q --no-index --no-deps --no-compile \
#       --no-cache-dir --upgrade --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
DIR=${1:-.whl}
PY=${PY:-python3}
WHEELS=(
  guidellm==0.8.1
  aiologic==0.17.1 annotated-types==0.8.0 click==8.4.2 culsans==0.10.0 datasets==5.2.0 dill==0.4.1
  eval_type_backport==0.4.0 Faker==40.63.0 ftfy==6.3.1 h2==4.4.1 hpack==4.2.0 html5tagger==2.0.0
  httptools==0.9.0 hyperframe==6.1.0 loguru==0.7.3 more-itertools==11.2.1 multiprocess==0.70.19
  pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
  sanic==25.12.1 sanic-routing==23.12.0 sniffio==1.3.1 tracerite==2.6.5 typing-inspection==0.4.5
  typing_extensions==4.16.0 ujson==6.1.0 wcwidth==0.9.4 websockets==17.4
)
mkdir -p "$DIR"
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do plat+=(--platform "$p"); done
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  "${plat[@]}" -d "$DIR" "${WHEELS[@]}"
ls "$DIR"/*.whl | wc -l | xargs echo "wheels:"
du -sh "$DIR"
