"""The bootstrap folder ``run`` puts first on PYTHONPATH: only ``sitecustomize`` lives here."""
