"""The admin console: a web page at /console for admins and billing (tenants, keys, adapters,
usage, engines), over the admin REST. Plain ES modules and CSS in static/, uPlot vendored for
the usage chart; nothing is built at install time and nothing comes from a CDN."""
