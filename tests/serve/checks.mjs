// What the dtp-serve test scripts share: checks that print "NAME: FAILED:
// what" and count, and JSON comparison and display.
export function checker(name) {
  let failures = 0;
  return {
    check: (ok, what) => {
      if (!ok) {
        failures++;
        console.log(`${name}: FAILED: ${what}`);
      }
    },
    failed: () => failures > 0,
  };
}
export const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
export const show = (s) => JSON.stringify(s);
