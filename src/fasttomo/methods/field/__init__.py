"""The field method: poses -> rays -> field -> line integrals -> intensity model, and its losses."""
