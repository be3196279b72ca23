"""What the Lightning integrations (the Trainer callback, Fabric) share: settings from code and environment,
the Trainer callback's behaviour, and every private name of Lightning the package reaches (``internals``)."""
