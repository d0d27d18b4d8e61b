"""`python -m training SPEC.json --output-dir DIR ...`: train one run spec (training.launch)."""
from training.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
