"""The Lightning integrations (the Trainer callback, Fabric's) and every private name of Lightning they reach."""
