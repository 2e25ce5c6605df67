"""`torchvision` for plugins: the models of `torchvision.models` that run
on the kit's layers (the ResNet family), with torchvision's parameter
names, shapes and initialisation, so `load_state_dict` takes a torchvision
model's weights. No datasets, transforms or pretrained downloads (a plugin
reads its data from a granted folder)."""

from . import models

__all__ = ["models"]
