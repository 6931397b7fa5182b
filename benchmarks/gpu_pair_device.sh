#!/usr/bin/env bash
# The job that produced benchmarks/results/gpu_pair.json on a lent H200 (nothing can be fetched there, and
# at most 64 MiB travels per call). How it ran: the two GGUFs, concatenated (0.5B first), were split into
# chunks (`split -b 60300000`); the first device call installed the llguidance and gguf wheels into
# /root/site, copied this script and the prompts file (`python -m benchmarks.gpu_pair --write-prompts`)
# to $S and started it detached (`setsid nohup bash $S/job.sh "$PWD" &`) with the first chunk; each later
# call moved one more chunk into $S; the last touched $S/READY and waited for $S/DONE. While the chunks
# arrive it runs gpu_check.sh (the equivalence tests on cuda); then it checks both digests and runs the pair.
S=${S:-/root/stash}
rm -rf /root/repo && mkdir -p /root/repo && cp -r "$1"/. /root/repo/ && rm -rf /root/repo/.gpu /root/repo/.whl
cd /root/repo
export PYTHONPATH=/root/site:/root/repo PYTHONUNBUFFERED=1
{
  echo "== $(date +%T) gpu_check.sh (equivalence tests on cuda, random-weight speed check)"
  timeout 300 bash benchmarks/gpu_check.sh
  echo "== $(date +%T) waiting for the GGUF chunks"
  until [ -e $S/READY ]; do sleep 1; done
  echo "== $(date +%T) assembling"
  cat $S/c?? > $S/all.bin && rm -f $S/c??
  head -c 491400064 $S/all.bin > $S/q05.gguf && tail -c +491400065 $S/all.bin > $S/q15.gguf && rm -f $S/all.bin
  sha256sum $S/q05.gguf $S/q15.gguf
  echo "expect 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 (0.5B), cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 (1.5B)"
  echo "== $(date +%T) the pair on cuda"
  timeout 900 python3 benchmarks/gpu_pair.py --target $S/q15.gguf --drafter $S/q05.gguf --device cuda \
    --prompts-file $S/prompts.json --prompts 12 --out $S/gpu_pair
  echo "== $(date +%T) done rc $?"
} > $S/job.log 2>&1
touch $S/DONE
