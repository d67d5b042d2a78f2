#!/usr/bin/env bash
# Copies what `python -m bench.engine.step_grid` reads from ../shared into .stepgridcarry/
# (git-ignored), for the GPU machine, which gets the working tree but not ../shared: the GPT-2
# tokenizer files (the models' tokenizer) and the xxhash and protobuf wheels the image lacks.
#
# Run from the repository root:
#     bash bench/engine/step_grid_carry.sh
# carry `.stepgridcarry` and run the device command in bench/engine/step_grid.py's docstring.
source "$(dirname "$0")/carry_lib.sh"
carry_start .stepgridcarry
carry_wheels xxhash protobuf
carry_done
