"""The embedded arithmetic task -> train/test parquet (no download; see open_instruct/arithmetic_task.py).

    python -m scripts.data_preprocess.arithmetic --output_dir data/arithmetic --digits 1 --operations + -
"""

import argparse

from open_instruct.data.arithmetic_task import make_arithmetic_rows, write_arithmetic_dataset
from scripts.data_preprocess.common import OUTPUT_FORMATS, PromptRow, cli, format_row, write_split


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True, help="Writes {output_dir}/train.parquet and test.parquet.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the train/test partition of the questions.")
    parser.add_argument("--digits", type=int, default=1, help="Digits per operand.")
    parser.add_argument("--operations", nargs="+", default=["+"], help="Any of + - *.")
    parser.add_argument("--test_fraction", type=float, default=0.25, help="Share of the questions held out.")
    parser.add_argument("--format", choices=OUTPUT_FORMATS, default="open_instruct", help="Output row schema.")
    args = parser.parse_args(argv)
    task = {"seed": args.seed, "digits": args.digits, "operations": tuple(args.operations)}
    if args.format == "open_instruct":  # the task module's own writer is the reference for this schema
        written = write_arithmetic_dataset(args.output_dir, test_fraction=args.test_fraction, **task)
    else:
        written = {}
        for split, rows in make_arithmetic_rows(test_fraction=args.test_fraction, **task).items():
            prompt_rows = [PromptRow(row["messages"], row["ground_truth"], row["dataset"]) for row in rows]
            formatted = [format_row(row, args.format, split, index) for index, row in enumerate(prompt_rows)]
            written[split] = write_split(formatted, args.output_dir, split, args.format)
    for split, path in written.items():
        print(f"{split}: wrote {path}")
    return written


if __name__ == "__main__":
    cli(main)
