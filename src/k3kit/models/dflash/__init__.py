"""The `dflash` GGUF architecture (DFlash / DSpark drafts): adapter.py loads one as a runtime Draft.
The network itself is k3kit.models.dspark."""
