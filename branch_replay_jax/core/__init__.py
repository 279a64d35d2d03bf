"""Model-agnostic replay: replay_vjp on groups (replay.py), nested replay on trees (tree_replay.py), and the
micro-batch scan-accumulate every replay and naive path uses (accumulate.py). See docs/design.md, "The replay math"."""
