// Entry point (no inline script, so a strict Content-Security-Policy can apply).
import { render } from "./app.js";
import { installCardHelp } from "./cardhelp.js";
import { installThemeToggle } from "./themetoggle.js";
import { installViews } from "./views.js";

installThemeToggle(); // before the first chart is drawn: the charts start in the page's theme
installViews();
render();
installCardHelp();
