// Entry point (no inline script, so a strict Content-Security-Policy can apply).
import { render } from "./app.js";
import { installCardHelp } from "./cardhelp.js";

render();
installCardHelp();
