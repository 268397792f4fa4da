#!/usr/bin/env bash
# B6's peers in their own venv, .venv-bench (their pins differ from hvdtrain's): mosaicml-streaming, LitData,
# WebDataset, with torch and moto's server. torch is PyPI's CUDA build (it runs on a machine without a GPU):
# mosaicml-streaming imports torchvision, and PyPI's torchvision 0.28 is linked against that build (with this
# machine's local CPU torch its operators fail to load). About 3 minutes and 6 GB; run once:
#     bash bench/b6/setup.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${1:-.venv-bench}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check \
    'torch==2.13.0,!=2.13.0+cpu' mosaicml-streaming==0.13.0 litdata==0.2.76 webdataset==1.0.2 \
    'moto[server]==5.2.5' boto3 numpy psutil
"$venv/bin/python" -c "import streaming, litdata, webdataset, moto; print('bench venv ready:', '$venv')"
