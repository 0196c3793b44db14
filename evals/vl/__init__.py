"""The visual world of the VL recipe: image sources that training data and held-out evals share, so a
held-out image can be kept out of training by construction (`scenes`, `easyvqa`, `digits`)."""
