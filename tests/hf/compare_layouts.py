"""compare_logits.py and compare_export.py for every layout of one folder,
in one process (importing torch once, not twice per layout: the imports were
most of run_hf_check.sh's time).

    python3 tests/hf/compare_layouts.py JOBS RESULTS

JOBS: one layout per line, tab-separated: tag, reference, got, expect (as
compare_logits.py's --expect), original folder, exported folder ("-": no
export to compare). RESULTS: a line per job, tab-separated: tag, "ok" or
"FAILED", the logits' figures, the export's (each with newlines as " | ").
Exits 0 when it could compare every job (a failed comparison is a result,
not an error).
"""

import sys

import compare_export
import compare_logits


def one_line(text):
    return text.replace("\t", " ").replace("\n", " | ")


def main():
    if len(sys.argv) != 3:
        raise SystemExit("usage: compare_layouts.py JOBS RESULTS")
    with open(sys.argv[1]) as jobs, open(sys.argv[2], "w") as results:
        for line in jobs:
            if not line.strip():
                continue
            tag, ref, got, expect, model, exported = line.rstrip("\n").split("\t")
            try:
                ok, figures = compare_logits.compare(ref, got, expect)
            except Exception as e:  # an unreadable file is this layout's failure
                ok, figures = False, f"compare_logits: {type(e).__name__}: {e}"
            export = "no export"
            if exported != "-":
                try:
                    export_ok, export = compare_export.compare(model, exported)
                except Exception as e:
                    export_ok, export = False, f"compare_export: {type(e).__name__}: {e}"
                ok = ok and export_ok
            results.write("\t".join([tag, "ok" if ok else "FAILED", one_line(figures), one_line(export)]) + "\n")


if __name__ == "__main__":
    main()
