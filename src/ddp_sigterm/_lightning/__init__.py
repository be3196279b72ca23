"""What the Lightning integrations (the Trainer callback, Fabric) share, and every private name of Lightning the
package reaches (``internals``)."""
