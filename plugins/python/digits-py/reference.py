"""The same models and loop as `app.py`, under real PyTorch: writes the
initial weights (`<out>/<name>.safetensors`) and the data as a plain CSV
(`<out>/digits.csv`), trains, and prints `{"losses": [...], "accuracy":
...}` as JSON.

    python reference.py DIGITS_CSV_GZ OUT_DIR MODEL EPOCHS LR
"""

import gzip
import json
import sys

import torch
from safetensors.torch import save_file

import model as m


def main():
    digits_gz, out, name, epochs, lr = sys.argv[1:6]
    with gzip.open(digits_gz, "rt") as f:
        text = f.read()
    # The first 512 images keep the plugin's run short.
    lines = [line for line in text.splitlines() if line.strip()][:512]
    with open(f"{out}/digits.csv", "w") as f:
        f.write("\n".join(lines) + "\n")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = m.make_model(name, dropout=False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{out}/{name}.safetensors")
    images, labels = m.read_digits(f"{out}/digits.csv")
    losses = m.train(model, images, labels, int(epochs), float(lr))
    print(json.dumps({"losses": losses, "accuracy": m.accuracy(model, images, labels)}))


if __name__ == "__main__":
    main()
