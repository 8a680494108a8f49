set -x
export PYTHONPATH=$PWD
t0=$(date +%s)
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py -q build_ext --inplace > $OUT/build.log 2>&1 || { tail -50 $OUT/build.log; exit 1; }
echo build $(( $(date +%s)-t0 ))s
FLA_EXT_POISON=1 timeout 200 python3 -m pytest -q -x -m cuda tests/test_chunk_rwkv7.py tests/test_rwkv7.py 2>&1 | tail -15
python3 benchmarks/kernel_times.py chunk_rwkv7 --K 64 --reps 20 2>&1 | tail -12
python3 benchmarks/kernel_times.py chunk_rwkv7 --K 64 --bwd --reps 10 2>&1 | tail -15
echo total $(( $(date +%s)-t0 ))s
