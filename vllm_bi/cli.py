"""``vllm-bi`` command line (filled in below)."""
import sys
def main(argv=None):
    print("vllm-bi: see --help"); return 0
